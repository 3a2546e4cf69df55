"""THD packing vs padding: training tokens/s on a length-skewed dataset, same model, same docs.

A GLM-5 at tiny depth but wider (hidden 256, 4 layers, 8 experts), random init, fp32, 1 thread.
Documents: lengths drawn from a heavy-tailed distribution (most short, a few up to 512), in random
order. Each step processes a token budget of 2048:
- packed: whole documents back to back (THD, ``glm5_mcore.data.sft.pack``), no padding;
- padded: as many documents as fit when each is padded to the longest in its batch ([B, L], the
  usual ``DataCollatorWithPadding`` layout).
Both run forward + backward over the same documents. Throughput counts real (non-pad) tokens.
Ideal speed-up = padded tokens / real tokens (the padding waste); target: packed/padded ≥ 0.9 × ideal.

Usage: .venv/bin/python bench/sft_packing.py [--docs 96]
"""

from __future__ import annotations

import argparse
import json
import random
import time

BUDGET = 2048


def _docs(n: int, seed: int):
    from glm5_mcore.data.sft import Document

    r = random.Random(seed)
    docs = []
    for _ in range(n):
        length = min(512, max(8, int(r.paretovariate(1.2) * 24)))
        toks = [r.randrange(10, 500) for _ in range(length + 1)]
        docs.append(Document(toks, [1] * len(toks), "bench"))
    return docs


def _padded_batches(docs, budget: int):
    import torch

    batches, cur = [], []
    for d in docs:
        longest = max([len(x) for x in cur] + [len(d)])
        if cur and longest * (len(cur) + 1) > budget:
            batches.append(cur)
            cur = []
        cur.append(d)
    if cur:
        batches.append(cur)
    out = []
    for b in batches:
        L = max(len(d) for d in b)
        ids = torch.zeros(len(b), L, dtype=torch.long)
        labels = torch.zeros(len(b), L, dtype=torch.long)
        mask = torch.zeros(len(b), L)
        for i, d in enumerate(b):
            n = len(d)
            ids[i, :n] = torch.tensor(d.tokens[:-1])
            labels[i, :n] = torch.tensor(d.tokens[1:])
            mask[i, :n] = 1
        out.append((ids, labels, mask))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from glm5_mcore.config import glm5_tiny
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.model.parallel import init_parallel
    from glm5_mcore.data.sft import pack

    cfg = glm5_tiny()
    cfg.hidden_size, cfg.vocab_size, cfg.index_topk, cfg.max_position_embeddings = 256, 512, 4096, 4096
    cfg.intermediate_size, cfg.moe_intermediate_size = 512, 128
    init_parallel(ParallelConfig())
    model = build_model(cfg).train()
    docs = _docs(a.docs, a.seed)
    real = sum(len(d) for d in docs)
    packed = pack(docs, BUDGET)
    padded = _padded_batches(docs, BUDGET)
    padded_tokens = sum(int(ids.numel()) for ids, _, _ in padded)

    def run_packed():
        for b in packed:
            ce = model(b.input_ids, b.position_ids, None, labels=b.labels, packed_seq_params=b.packed_seq_params())
            (ce * b.loss_mask).sum().backward()

    def run_padded():
        for ids, labels, mask in padded:
            pos = torch.arange(ids.shape[1])[None].expand_as(ids)
            ce = model(ids, pos, None, labels=labels)
            (ce * mask).sum().backward()

    times = {}
    for name, fn in (("packed", run_packed), ("padded", run_padded), ("packed", run_packed), ("padded", run_padded)):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times[name] = min(times.get(name, float("inf")), dt)
    tps = {k: real / v for k, v in times.items()}
    ratio = tps["packed"] / tps["padded"]
    ideal = padded_tokens / real
    print(f"{len(docs)} documents, {real} real tokens; padded layout {padded_tokens} tokens "
          f"({100 * (1 - real / padded_tokens):.0f}% padding) in {len(padded)} batches; packed in {len(packed)}")
    print(f"{'layout':<8} {'time s':>8} {'real tokens/s':>14}")
    for k in ("packed", "padded"):
        print(f"{k:<8} {times[k]:8.2f} {tps[k]:14.0f}")
    print(f"packed / padded = {ratio:.2f}x; padding-waste ideal {ideal:.2f}x; {ratio / ideal:.2f} of ideal "
          f"(target >= 0.9)")
    print(json.dumps({"real_tokens": real, "padded_tokens": padded_tokens, "tokens_per_s": tps,
                      "speedup": ratio, "ideal_speedup": ideal, "fraction_of_ideal": ratio / ideal,
                      "target_fraction": 0.9, "pass": ratio / ideal >= 0.9}))


if __name__ == "__main__":
    main()
