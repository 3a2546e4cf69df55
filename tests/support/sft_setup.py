"""SFT set-ups shared by the SFT, data, plan and checkpoint-interop tests: the reverse-counting toy
task, the tiny SFT configs (20-step full fine-tune; one LoRA step) and their rows."""

import json
import random
from pathlib import Path


def tokenizer(hf_dir):
    """The HF folder's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def reverse_task(path, n, seed, lengths=(3, 12)):
    """Prompts of random words; the response counts up from the first word (w7 -> w7 w8 w9 w10):
    learnable from local patterns, so held-out rows improve too."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a = [r.randrange(90) for _ in range(r.randrange(*lengths))]
            resp = " ".join(f"w{a[0] + k}" for k in range(4))
            f.write(json.dumps({"prompt": " ".join(f"w{x}" for x in a), "response": resp}) + "\n")
    return str(path)


def sft_cfg(tiny_dir, tmp_path, **over):
    """A 20-step full fine-tune of the tiny model on the reverse task (64 rows, 8 held out) into TMP/run; ``over`` updates sections."""
    from recipes.sft import SFTConfig

    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    d = {"model": {"hf_dir": tiny_dir},
         "data": {"train": reverse_task(tmp_path / "train.jsonl", 64, 0),
                  "valid": reverse_task(tmp_path / "valid.jsonl", 8, 1),
                  "micro_batch_tokens": 128, "global_batch_tokens": 256, "max_tokens": 64},
         "optim": {"lr": 3e-3, "decay_style": "constant"},
         "lora": {"enabled": False},
         "train": {"steps": 20, "out": str(tmp_path / "run"), "eval_every": 20, "progress": False},
         "wandb": {"mode": "disabled"}}
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return SFTConfig.from_dict(d)


def count_rows(path, n=24, seed=0, extra=()):
    """``n`` rows of the reverse task (prompts of 3-9 words) and the raw lines ``extra`` after them."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a = [r.randrange(90) for _ in range(r.randrange(3, 10))]
            f.write(json.dumps({"prompt": " ".join(f"w{x}" for x in a),
                                "response": " ".join(f"w{a[0] + k}" for k in range(4))}) + "\n")
        for row in extra:
            f.write(row + "\n")
    return str(path)


def lora_step_cfg(tiny_dir, root, **over):
    """One LoRA (rank 4) SFT step on ROOT/train.jsonl, saved at iteration 1 into ROOT/run; ``over`` updates sections."""
    from recipes.sft import SFTConfig

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    d = {"model": {"hf_dir": tiny_dir},
         "data": {"train": str(root / "train.jsonl"), "micro_batch_tokens": 128, "global_batch_tokens": 128,
                  "max_tokens": 64},
         "optim": {"lr": 1e-3, "decay_style": "constant"},
         "lora": {"enabled": True, "rank": 4},
         "train": {"steps": 1, "save_every": 1, "out": str(root / "run"), "progress": False},
         "wandb": {"mode": "disabled"}}
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return SFTConfig.from_dict(d)
