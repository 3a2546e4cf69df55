"""The first things a lent GPU must confirm, in one call (``shared/notes/gpu-path-review.md`` checks 1-3,
then the bf16 log-prob figure and what only NCCL can show).

1. **model on the device**: ``build_model`` + LoRA leave no parameter or buffer off the training device,
   and Megatron's optimizer (bf16 on CUDA: ``Float16Optimizer``, which takes CUDA tensors only) builds;
2. **SFT batch on the device**: one THD-packed SFT step (``recipes.sft.step_losses`` through Megatron's
   schedule, then the optimizer step) runs, its loss is finite and the LoRA weights moved;
3. **collectives on device tensors**: during that step and an RL trainer's log-prob pass + update, every
   tensor handed to a ``torch.distributed`` collective (ours and Megatron-Core's) is on the training
   device (NCCL rejects CPU tensors); under ``torchrun --nproc_per_node N`` on N GPUs the same runs at DP N.
4. bf16 RL log-probs with the fp32 output layer vs a float64 projection of the same hidden states, and
   with bf16 logits (the rounding IcePop's ratios would carry), side by side.
5. NCCL-only, with >= 2 GPUs under torchrun: the distributed optimizer (DP >= 2) saved and restored
   through ``dist_checkpointing`` continues bit-identically (Adam moments and fp32 main params equal
   after a resume). Reported as "needs >= 2 GPUs" otherwise.

Without CUDA the checks run on the CPU, where 1-3 are vacuous (everything is on the CPU): the JSON says
so (``"device": "cpu"``). ``--stand-in`` runs them on the test suite's stand-in accelerator
(``tests/support/fake_device.py``: tensors on ``meta`` with CPU values), which does catch device bugs on CPU.

Usage: .venv/bin/python bench/gpu_check.py [--hf-dir DIR] [--stand-in]
       torchrun --nproc_per_node 2 bench/gpu_check.py          (2 GPUs: DP 2 and the NCCL-only check)
Last line: JSON {"device", "world", "checks": {name: {"ok", ...}}, "figures", "targets", "all_ok"}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _check(results: dict, name: str):
    """Record ``name``: ok, seconds, and the error (one line + the innermost frames) if it raised."""

    @contextlib.contextmanager
    def run():
        t0 = time.perf_counter()
        entry = results.setdefault(name, {})
        try:
            yield entry
            entry.setdefault("ok", True)
        except Exception as e:  # a failed check is a finding: keep going to the next one
            entry["ok"] = False
            entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            entry["where"] = traceback.format_exc().strip().splitlines()[-3:-1]
        entry["seconds"] = round(time.perf_counter() - t0, 2)

    return run()


def _data(path: Path, n: int = 32) -> str:
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{(i * 11 + k) % 90}" for k in range(3 + i % 7))
            f.write(json.dumps({"prompt": words, "response": f"w{i % 80} w{i % 80 + 1} w{i % 80 + 2}"}) + "\n")
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", default=None, help="an HF GLM-5 folder (default: a tiny one written to a temp dir)")
    ap.add_argument("--stand-in", action="store_true", help="CPU only: run on the tests' stand-in device")
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    from fake_device import assert_collectives_on, fake_device
    from glm5_mcore.config import GLM5Config, ParallelConfig
    from glm5_mcore.device import training_device
    from glm5_mcore.model.parallel import init_parallel

    cuda = torch.cuda.is_available()
    if a.stand_in and cuda:
        ap.error("--stand-in is for CPU-only machines")
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    hf_dir = a.hf_dir
    if hf_dir is None:
        from glm5_mcore.tiny import write_tiny

        hf_dir = str(write_tiny(tmp / "tiny", seed=0))
    init_parallel(ParallelConfig())
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    bf16 = cuda  # Megatron's bf16 optimizer needs CUDA
    checks: dict = {}
    figures: dict = {}
    outer = fake_device() if a.stand_in else contextlib.nullcontext()
    with outer:
        dev = training_device()
        seen, bad = [], []
        with assert_collectives_on(dev, seen, bad):
            # 1. the model on the device, and the optimizer over it
            with _check(checks, "1_model_on_device") as c:
                from glm5_mcore.lora.config import LoRAConfig
                from glm5_mcore.lora.apply import apply_lora
                from glm5_mcore.model.build import build_model
                from glm5_mcore.checkpoint.hf_load import load_hf_weights
                from glm5_mcore.training.loop import OptimCfg, build_trainer

                over = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
                model = build_model(glm5, ParallelConfig(), calculate_per_token_loss=True, **over)
                load_hf_weights(model, hf_dir, glm5)
                apply_lora(model, LoRAConfig(rank=4, init="random", seed=1), "default")
                off = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != dev.type]
                c["off_device"] = off[:8]
                c["tensors"] = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
                ddp, opt, sched = build_trainer(model, OptimCfg(lr=1e-3, decay_style="constant"), 4, bf16=bf16)
                c["optimizer"] = type(opt).__name__
                c["ok"] = not off
            # 2. one SFT step with its batch on the device
            with _check(checks, "2_sft_batch_on_device") as c:
                from transformers import AutoTokenizer

                from glm5_mcore.data.sft import pack, read_jsonl
                from recipes.sft import step_losses

                docs = read_jsonl(_data(tmp / "d.jsonl"), AutoTokenizer.from_pretrained(hf_dir), 64)
                batches = pack(docs, 128)[:2]
                before = [p.detach().float().clone() for n, p in model.named_parameters() if ".lora." in n]
                ddp.zero_grad_buffer()
                opt.zero_grad()
                s, n = step_losses(ddp, batches, forward_only=False)
                ok, grad_norm, _ = opt.step()
                after = [p.detach().float() for n, p in model.named_parameters() if ".lora." in n]
                moved = sum(int(not torch.equal(x, y.to(x.device))) for x, y in zip(before, after))
                c.update(loss=s / max(n, 1), grad_norm=float(grad_norm), lora_tensors_moved=moved)
                c["ok"] = bool(ok) and moved > 0 and float("inf") > s / max(n, 1) > 0
            # 3. collectives of SFT (above) and the RL trainer
            with _check(checks, "3_collectives_on_device") as c:
                from rl import algos
                from rl.batch import RolloutBatch
                from rl.config import RLConfig
                from rl.driver import fill_log_probs
                from rl.trainer import PolicyTrainer

                cfg = RLConfig.from_dict({"model": {"hf_dir": hf_dir}, "wandb": {"mode": "disabled"},
                                          "rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2},
                                          "trainer": {"bf16": bf16}})
                g = torch.Generator().manual_seed(0)
                prompts = [torch.randint(3, 90, (6 + 5 * (i // 2),), generator=g).tolist() for i in range(4)]
                responses = [torch.randint(3, 90, (4,), generator=g).tolist() for _ in range(4)]
                batch = RolloutBatch.build(prompts, responses, [[-1.0] * 4] * 4, [0, 0, 1, 1])
                batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
                trainer = PolicyTrainer(cfg, rank=dist.get_rank(), world=dist.get_world_size())
                outs = [None] * dist.get_world_size()
                dist.all_gather_object(outs, trainer.compute_log_probs(batch))
                fill_log_probs(batch, [o for o in outs if o is not None])
                batch.rollout_log_probs = batch.old_log_probs - 0.01
                algos.rollout_correction(cfg, batch)
                algos.compute_advantages(cfg, batch, 0.0)
                trainer.update(batch, step=0)
                c.update(checked=len(seen), violations=sorted(set(bad))[:10],
                         callers=sorted({w for _, w in seen}))
                c["ok"] = not bad and len(seen) > 0 if dist.get_world_size() > 1 else not bad
        # 4. bf16 log-probs: fp32 output layer vs bf16 logits, against a float64 projection
        with _check(checks, "4_bf16_logprobs") as c:
            if not bf16:
                c.update(ok=True, skipped="bf16 needs CUDA here (tests/model/test_bf16_logprobs.py covers it on CPU)")
            else:
                from glm5_mcore.model.mtp_loss import fp32_output_layer, token_logprobs

                m = trainer.model
                ids = torch.randint(3, glm5.vocab_size, (1, 48), generator=g).to(dev)
                targets = torch.randint(3, glm5.vocab_size, (48,), generator=g).to(dev)
                hidden = []
                h1 = m.output_layer.register_forward_pre_hook(lambda mod, args: hidden.append(args[0].detach()))
                res = {}
                for name in ("fp32_output_layer", "bf16_logits"):
                    hs = m.output_layer._forward_pre_hooks
                    saved = dict(hs)
                    if name == "bf16_logits":  # drop the trainer's fp32 upcast for the comparison
                        for k in [k for k, f in hs.items() if getattr(f, "__name__", "") == "upcast"]:
                            del hs[k]
                    with torch.no_grad():
                        logits = m(input_ids=ids, position_ids=torch.arange(48, device=dev)[None],
                                   attention_mask=None)[0]
                        res[name] = token_logprobs(logits, targets)[0].double()
                    hs.clear()
                    hs.update(saved)
                h1.remove()
                h = hidden[-1][:, 0].double()
                ref = torch.log_softmax(h @ m.output_layer.weight.double().T, -1).gather(-1, targets[:, None])[:, 0]
                for name, v in res.items():
                    figures[f"bf16_logprob_max_abs_{name}"] = float((v - ref).abs().max())
                c["ok"] = figures["bf16_logprob_max_abs_fp32_output_layer"] <= 2e-6 * max(1.0, float(ref.abs().max()))
        # 5. NCCL only: distributed optimizer resume
        with _check(checks, "5_distributed_optimizer_resume") as c:
            if not cuda or dist.get_world_size() < 2:
                c.update(ok=True, skipped="needs >= 2 GPUs under torchrun (the distributed optimizer is "
                                          "CUDA-only and DP >= 2)")
            else:
                c.update(_dist_opt_resume(hf_dir, tmp))
    shutil.rmtree(tmp, ignore_errors=True)
    out = {"device": str(training_device()) if not a.stand_in else "meta (stand-in)", "world": dist.get_world_size(),
           "vacuous_on_cpu": not cuda and not a.stand_in, "checks": checks, "figures": figures,
           "targets": {"1-3": "ok", "bf16_logprob_max_abs_fp32_output_layer": "<= 2e-6 * max(1, max |log p|)",
                       "5": "moments and fp32 main params equal bitwise after a resume"},
           "all_ok": all(v.get("ok") for v in checks.values())}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)


def _dist_opt_resume(hf_dir: str, tmp: Path) -> dict:
    """Four SFT steps with the distributed optimizer vs two + resume + two (same process group)."""
    import torch
    import torch.distributed as dist

    from glm5_mcore.checkpoint.layout import iter_dir
    from recipes.sft import SFTConfig, run

    out = tmp / "dist_opt"
    data = _data(tmp / "r.jsonl", 48)

    def cfg(name, steps):
        return SFTConfig.from_dict({
            "model": {"hf_dir": hf_dir}, "data": {"train": data, "micro_batch_tokens": 64,
                                                  "global_batch_tokens": 64 * dist.get_world_size() * 2,
                                                  "max_tokens": 48},
            "lora": {"rank": 4}, "optim": {"lr": 1e-3, "decay_style": "constant", "distributed": True},
            "train": {"steps": steps, "save_every": 2, "keep_last": 0, "eval_every": 0, "out": str(out / name),
                      "progress": False, "bf16": True}, "wandb": {"mode": "disabled"}})

    full = [h["loss"] for h in run(cfg("a", 4))["history"]]
    run(cfg("b", 2))
    resumed = [h["loss"] for h in run(cfg("b", 4))["history"]]
    from megatron.core.dist_checkpointing import load_plain_tensors

    a = load_plain_tensors(str(iter_dir(out / "a", 4) / "optimizer" / "dist"))
    b = load_plain_tensors(str(iter_dir(out / "b", 4) / "optimizer" / "dist"))
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    differ = [k for k in tensors if not torch.equal(a[k], b[k])]
    return {"ok": resumed == full[2:] and not differ and bool(tensors), "losses_full": full,
            "losses_resumed": resumed, "state_tensors": len(tensors), "differ": differ[:5]}


if __name__ == "__main__":
    main()
