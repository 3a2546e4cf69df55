"""Write a small GSM8K-style arithmetic prompt set in verl's parquet format (its gsm8k preprocessor's
columns), for ``configs/rl/math_verl_tiny.yaml`` and ``code_tool_tiny.yaml``:

    python scripts/make_verl_math.py --out runs/verl_math      # train.parquet (256 rows), test.parquet (64)

Rows: ``data_source`` "openai/gsm8k", ``prompt`` one user message ending in verl's instruction to answer
after "####", ``ability`` "math", ``reward_model`` {"style": "rule", "ground_truth": "<number>"},
``extra_info`` {"split", "index", "question", "answer"} — what a user's verl data looks like. The folder is
written anew (refused when it exists and is not one this script wrote) and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", lambda a, b: a + b),
    ("A box holds {a} pens. {name} takes {b} boxes. How many pens does {name} take?", lambda a, b: a * b),
    ("{name} had {a} coins and spent {b}. How many coins are left?", lambda a, b: a - b),
]
NAMES = ["Tom", "Ana", "Li", "Sam", "Noor", "Ivan"]
MARKER = ".verl_math"


def rows(split: str, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    out = []
    for i in range(count):
        text, fn = TEMPLATES[i % len(TEMPLATES)]
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        q = text.format(name=rng.choice(NAMES), a=a, b=b)
        ans = fn(a, b)
        out.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(ans)},
                    "extra_info": {"split": split, "index": i, "question": q, "answer": f"#### {ans}"}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/verl_math")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(a.out)
    if out.exists() and not (out / MARKER).is_file():
        print(f"error: {out} exists and was not written by this script; choose another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", a.train), ("test", a.test)):
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows(split, n, a.seed)), tmp)
        tmp.replace(out / f"{split}.parquet")
    (out / MARKER).write_text("written by scripts/make_verl_math.py\n")
    print(f"{out}: train.parquet ({a.train} rows), test.parquet ({a.test} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
