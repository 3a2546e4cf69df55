"""Run under torchrun (2 gloo ranks, DP 2, Megatron's distributed optimizer): ``overlap_param_gather``.

1. Two optimizer steps through Megatron's schedule with and without the overlap; what each rank's model holds
   right after the step (``stale``: the other rank's shard not gathered yet) and inside ``synced_params``; a third
   step (its forward gathers through the pre-hooks, so its loss matches) and the synced parameters after it.
2. The SFT recipe (full fine-tuning, 4 steps, evaluation every 3, a save every 2: the save at 2 follows no forward)
   with and without the overlap:
   losses, validation losses, and the saved weights (loaded back into a fresh model).

With ``lora`` as the third argument, only the LoRA case (issue 39 G3): adapters on the default targets, three
steps with and without the overlap; the adapters' forward must wait for their own bucket's gather.

Prints one JSON line (rank 0)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from glm5_mcore.lora.apply import apply_lora
from glm5_mcore.lora.config import LoRAConfig
from glm5_mcore.training.loop import OptimCfg, build_trainer, synced_params
from tests.support.helpers import hf_model, megatron_steps
from tests.support.sft_setup import reverse_task


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def steps(tiny: str) -> dict:
    ids = torch.randint(0, 100, (1, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    got = {}
    for overlap in (False, True):
        model, _ = hf_model(tiny)
        ddp, opt, _ = build_trainer(model, OptimCfg(lr=1e-2, decay_style="constant", distributed=True,
                                                    overlap_param_gather=overlap), 3)
        losses = megatron_steps(ddp, opt, ids, 2)
        after_step = _params(model)
        with synced_params(ddp, opt):
            synced = _params(model)
        losses += megatron_steps(ddp, opt, ids, 1)  # the pre-hooks are back: this forward gathers step 2
        hooks = len(ddp.remove_forward_pre_hook_handles)
        with synced_params(ddp, opt):
            final = _params(model)
        got[overlap] = dict(after_step=after_step, synced=synced, losses=losses, final=final, hooks=hooks,
                            ddp=ddp.ddp_config.overlap_param_gather)
    plain, ov = got[False], got[True]
    return {"stale": _max_diff(ov["after_step"], plain["after_step"]),
            "synced": _max_diff(ov["synced"], plain["synced"]), "final": _max_diff(ov["final"], plain["final"]),
            "losses": [plain["losses"], ov["losses"]], "hooks": [plain["hooks"], ov["hooks"]],
            "ddp_flag": [plain["ddp"], ov["ddp"]]}


def lora_steps(tiny: str) -> dict:
    """Three LoRA steps (adapters only train) with and without the overlap: the losses and the synced adapters."""
    ids = torch.randint(0, 100, (1, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    got = {}
    for overlap in (False, True):
        model, _ = hf_model(tiny)
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0, init="random"))
        ddp, opt, _ = build_trainer(model, OptimCfg(lr=3e-2, decay_style="constant", distributed=True,
                                                    overlap_param_gather=overlap), 3)
        losses = megatron_steps(ddp, opt, ids, 3)
        with synced_params(ddp, opt):
            final = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        got[overlap] = dict(losses=losses, final=final)
    return {"losses": [got[False]["losses"], got[True]["losses"]],
            "final": _max_diff(got[False]["final"], got[True]["final"]), "n": len(got[True]["final"])}


def sft(tiny: str, out: Path) -> dict:
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import iter_dir
    from recipes.sft import SFTConfig, run

    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        reverse_task(out / "train.jsonl", 32, 0)
        reverse_task(out / "valid.jsonl", 8, 1)
    dist.barrier()
    res = {}
    for overlap in (False, True):
        cfg = SFTConfig.from_dict({
            "model": {"hf_dir": tiny},
            "data": {"train": str(out / "train.jsonl"), "valid": str(out / "valid.jsonl"), "micro_batch_tokens": 64,
                     "global_batch_tokens": 256, "max_tokens": 32},
            "optim": {"lr": 3e-3, "decay_style": "constant", "distributed": True, "overlap_param_gather": overlap},
            "lora": {"enabled": False},
            "train": {"steps": 4, "out": str(out / f"run{int(overlap)}"), "eval_every": 3, "save_every": 2,
                      "progress": False},
            "wandb": {"mode": "disabled"}})
        r = run(cfg)
        saved = {}
        for step in (2, 4):
            m, _ = hf_model(tiny)
            load_model(m, iter_dir(out / f"run{int(overlap)}", step) / "model")
            saved[step] = _params(m)
        res[overlap] = (r, saved)
    (a, sa), (b, sb) = res[False], res[True]
    return {"loss": [[h["loss"] for h in a["history"]], [h["loss"] for h in b["history"]]],
            "val": [a["val"], b["val"]], "saved": {s: _max_diff(sa[s], sb[s]) for s in (2, 4)}}


def main(tiny: str, out: str, case: str = "full") -> None:
    dist.init_process_group("gloo")
    res = {"lora": lora_steps(tiny)} if case == "lora" else {"steps": steps(tiny), "sft": sft(tiny, Path(out))}
    if dist.get_rank() == 0:
        print(json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
