"""Writes the SFT example set the docs' commands train on: ``examples/sft_tiny.jsonl`` (1024 rows) and
``examples/sft_tiny_valid.jsonl`` (64 held-out rows), ``{"prompt", "response"}`` rows of a toy task the
tiny model (``glm5 tiny``, a word-level vocabulary of w0 ... w99) can learn: the response counts up
from the prompt's first word (``w7 w31 w2`` -> ``w7 w8 w9 w10``). Deterministic (seeded), so the
committed files are exactly what this prints; rerun it to check or to make more rows.

Usage: python examples/make_sft_tiny.py [--rows 1024] [--valid 64] [--out-dir examples]
"""

import argparse
import json
import random
from pathlib import Path


def rows(n: int, seed: int) -> list[dict]:
    """``n`` rows: a prompt of 3-11 words w0..w89, the response the four words counting up from its first."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        a = [r.randrange(90) for _ in range(r.randrange(3, 12))]
        out.append({"prompt": " ".join(f"w{x}" for x in a), "response": " ".join(f"w{a[0] + k}" for k in range(4))})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--valid", type=int, default=64)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent))
    a = p.parse_args()
    out = Path(a.out_dir)
    for name, n, seed in (("sft_tiny.jsonl", a.rows, 0), ("sft_tiny_valid.jsonl", a.valid, 1)):
        path = out / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows(n, seed)))
        print(f"{path}: {n} rows")


if __name__ == "__main__":
    main()
