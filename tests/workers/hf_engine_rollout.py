"""The embedded HF engine's rollout of the tiny model under another interpreter's transformers (the test runs it
with ``.venv-vllm``'s, 5.19, whose ``forward`` takes ``past_key_values`` as 5.17 does): argv tiny_dir, n, count,
max_new_tokens; prints one JSON line {"transformers", "cache_kw", "results": [[key, ids, logprobs]]}."""

import json
import sys

import torch
import transformers
from transformers import AutoTokenizer

from rl.rollout.base import Request, SamplingParams, sample_seed
from rl.rollout.hf_engine import HFRolloutEngine
from rl.tasks.prompts import toy_prompts


def main() -> None:
    tiny_dir, n, count, max_new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    engine = HFRolloutEngine(tiny_dir)
    prompts = toy_prompts(tok, count, seed=0)
    for p in prompts:  # longer than index_topk (8): the indexer really selects
        p.ids = p.ids * 4
    reqs = [Request((p.index, k), p.ids, sample_seed(1, 0, p.index, k)) for p in prompts for k in range(n)]
    res = engine.generate(reqs, SamplingParams(0.8, 1.0, max_new, (tok.eos_token_id,)))
    print(json.dumps({"transformers": transformers.__version__, "cache_kw": getattr(engine, "cache_kw", None),
                      "results": [[list(r.key), r.response_ids, r.logprobs] for r in res]}))


if __name__ == "__main__":
    main()
