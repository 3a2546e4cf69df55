"""The first GPU run in one script: stages in order of value, each with a time budget and one JSON line,
stopping cleanly at a deadline, so a short lease (15 minutes on one H200) yields the most it can.

Stages (``--dry-run`` prints this plan with each budget, touching no GPU):

1. ``env``: torch / CUDA / GPU, and which of megatron-core, TileLang, Transformer Engine, vLLM import.
2. ``model_sft``: the model (local spec, bf16 on CUDA) + LoRA on the training device, Megatron's optimizer
   over it, one THD-packed SFT step through Megatron's schedule (finite loss, LoRA weights moved), every
   tensor handed to a collective on the device (``tests/support/fake_device.assert_collectives_on``).
3. ``rl_step``: the RL trainer's log-prob pass and one update on the device, its collectives on the
   device, and the bf16 log-prob figure (fp32 output layer vs bf16 logits against a float64 projection).
   verl's math runs without Ray (``rl.train.verl_import``): the lent image has none.
4. ``grouped_lora`` — ``bench/gpu_check_grouped.py``: LoRA on grouped routed experts (``moe_grouped_gemm=true``,
   ``experts.*`` targets), the stacked ``grouped_mm`` path against the per-expert one (logits and adapter
   gradients), no host sync from the adapters' path.
5. ``dsa`` — ``bench/gpu_check_dsa.py`` (the DSA issue's stage: fused DSA, scaling at real widths), when present.
6. ``resume``: SFT 4 steps vs 2 + resume + 2 under ``torch.use_deterministic_algorithms(True)`` with
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (the DSA backward's ``index_add_`` is non-deterministic otherwise)
   and LoRA dropout on (the CUDA / Megatron RNG state must travel with the checkpoint): losses and every
   optimizer tensor bitwise equal. The distributed optimizer when DP >= 2 (torchrun), else Megatron's
   ``Float16Optimizer``.
7. ``colocate`` — ``bench/gpu_check_colocate.py`` (the colocation stage), when present.
8. ``fp8_base`` — ``bench/gpu_check_fp8.py`` (the FP8-base issue's stage: TE's blockwise GEMM holding the release's
   FP8 bytes vs the CPU reference GEMM on the GPU; the weight's bytes outside and inside its backward), when present.
9. ``vllm_lora`` — ``bench/gpu_check_vllm_lora.py``: vLLM's real MoE-LoRA kernels serving the full-stack adapter in
   LoRA mode (routed experts in PEFT's 3D form, pushed in memory) against transformers + PEFT, where vLLM imports.
10. ``te_vllm``: prints what only a machine with Transformer Engine and vLLM can check, with the exact
   commands (also in ``docs/gpu.md``); runs them when both import.

**Stage contract** (for ``bench/gpu_check_<name>.py``): the module exposes ``BUDGET_S: int`` (seconds on one
H200) and ``def stage(ctx: dict) -> dict``. ``ctx`` holds at least ``device`` (``torch.device``; ``cpu`` in a
dry run), ``deadline`` (a ``time.monotonic()`` value the stage must finish by: check it and return
``{"skipped": "deadline"}`` rather than overrun), ``dry_run`` (True: touch no GPU, return ``{"plan": "<one
line>"}`` at once), ``out_dir`` (a writable ``pathlib.Path``) and ``hf_dir`` (a tiny GLM-5 HF folder). The
result must be JSON-serialisable; ``"ok": False`` marks a failed check; a stage that raises is recorded as
``ok: false`` with the error's line. This script imports each such file if present (by path), gives it its
slot and budget, and also interrupts it (``SIGALRM``) at its budget or the deadline, whichever comes first.

Each stage prints ``{"stage", "budget_s", "wall_s", "ok", ...}``; a stage whose budget no longer fits before
the deadline is skipped (``"skipped": "deadline"``); the last line is the summary JSON
``{"device", "deadline_s", "stages": {...}, "all_ok", "targets"}``.

Usage (the lent machine has no registry: ``scripts/gpu_wheels.sh --rl`` builds the carried wheels, and the
device tool's ``carry`` must name ``.whl``, which git ignores; ``docs/gpu.md`` lists them with their MiB)::

    python3 bench/gpu_check.py --dry-run                     # CPU: the plan and budget
    python3 bench/gpu_check.py --deadline-s 600 --out /tmp/gc   # one GPU
    torchrun --nproc_per_node 2 bench/gpu_check.py          # 2 GPUs: DP 2, the distributed optimizer
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic GEMMs possible
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TE_VLLM = {
    "te_forward": "python3 -m pytest -m gpu tests/gpu/test_gpu_te.py -x -s",
    "vllm_engine": "python3 -m pytest -m gpu tests/gpu/test_gpu_vllm.py -x -s",
    "rl_te_smoke": ("glm5 rl --config grpo_tiny trainer.backend=te trainer.bf16=true trainer.gpus_per_rank=1 "
                    "rollout.engine=rl.rollout.vllm_engine.VLLMRolloutEngine rollout.gpus_per_actor=1 "
                    "'rollout.engine_kwargs={merge: true, gpu_memory_utilization: 0.3}' trainer.steps=3"),
}
"""What only a machine with Transformer Engine and vLLM can check (neither travels as a carried wheel)."""


class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise ``StageTimeout`` in this (main) thread after ``seconds``: the deadline holds even for a stage
    that does not check it."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(*_):
        raise StageTimeout(f"interrupted after {seconds:.0f}s (its budget, or the deadline if sooner)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _data(path: Path, n: int = 32) -> str:
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{(i * 11 + k) % 90}" for k in range(3 + i % 7))
            f.write(json.dumps({"prompt": words, "response": f"w{i % 80} w{i % 80 + 1} w{i % 80 + 2}"}) + "\n")
    return str(path)


# ------------------------------------------------------------------------------------------ stages
def stage_env(ctx: dict) -> dict:
    """Versions, the GPU, and which optional packages import."""
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if ctx["dry_run"]:
        return {"plan": "torch/CUDA/GPU versions; imports megatron.core, tilelang, transformer_engine, vllm"}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2 ** 30, 1), capability=f"{p.major}.{p.minor}")
    for mod in ("megatron.core", "tilelang", "transformer_engine.pytorch", "vllm", "verl", "ray", "omegaconf"):
        try:
            if mod == "verl":  # its RL math, with or without Ray (rl.train.verl_import)
                from rl.train.verl_import import load as load_verl

                load_verl()
                out[mod] = importlib.metadata.version("verl")
                continue
            m = importlib.import_module(mod)
            out[mod] = getattr(m, "__version__", "yes")
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding
            out[mod] = f"no ({type(e).__name__})"
    out["ok"] = "no" not in str(out["megatron.core"])
    return out


def stage_model_sft(ctx: dict) -> dict:
    """Model + LoRA + optimizer on the device, one SFT step, its collectives on the device."""
    if ctx["dry_run"]:
        return {"plan": "build_model (local spec, bf16) + LoRA + Megatron optimizer on the device; one THD SFT "
                        "step: finite loss, LoRA moved, collectives' tensors on the device"}
    import torch

    from glm5_mcore.probes.fake_device import assert_collectives_on
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.data.sft import pack, read_jsonl
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.lora.config import LoRAConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.model.parallel import init_parallel
    from glm5_mcore.training.loop import OptimCfg, build_trainer
    from recipes.sft import step_losses
    from transformers import AutoTokenizer

    dev, hf_dir, bf16 = ctx["device"], ctx["hf_dir"], ctx["device"].type == "cuda"
    init_parallel(ParallelConfig())
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    over = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    model = build_model(glm5, ParallelConfig(), calculate_per_token_loss=True, **over)
    load_hf_weights(model, hf_dir, glm5)
    apply_lora(model, LoRAConfig(rank=4, init="random", seed=1), "default")
    off = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != dev.type]
    ddp, opt, _ = build_trainer(model, OptimCfg(lr=1e-3, decay_style="constant"), 4, bf16=bf16)
    seen, bad = [], []
    with assert_collectives_on(dev, seen, bad):
        docs = read_jsonl(_data(ctx["out_dir"] / "d.jsonl"), AutoTokenizer.from_pretrained(hf_dir), 64)
        batches = pack(docs, 128)[:2]
        before = [p.detach().float().clone() for n, p in model.named_parameters() if ".lora." in n]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        s, n = step_losses(ddp, batches, forward_only=False)
        ok, grad_norm, _ = opt.step()
    after = [p.detach().float() for n, p in model.named_parameters() if ".lora." in n]
    moved = sum(int(not torch.equal(x, y.to(x.device))) for x, y in zip(before, after))
    loss = s / max(n, 1)
    return {"off_device": off[:8], "optimizer": type(opt).__name__, "loss": loss, "grad_norm": float(grad_norm),
            "lora_tensors_moved": moved, "collective_violations": sorted(set(bad))[:10],
            "ok": not off and bool(ok) and moved > 0 and float("inf") > loss > 0 and not bad}


def rl_step_dict(hf_dir: str, cuda: bool) -> dict:
    """``rl_step``'s RL config (``tests/gpu/test_gpu_path.py`` validates it as on a GPU)."""
    return {"model": {"hf_dir": hf_dir}, "wandb": {"mode": "disabled"}, "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 2}, "trainer": {"bf16": cuda, "gpus_per_rank": 1 if cuda else 0}}


def stage_rl_step(ctx: dict) -> dict:
    """The RL trainer on the device: log-probs, one update, collectives; the bf16 log-prob figure."""
    if ctx["dry_run"]:
        return {"plan": "PolicyTrainer (local spec, bf16): compute_log_probs + one update on the device, "
                        "collectives on the device; bf16 log-probs (fp32 output layer vs bf16 logits) vs float64"}
    if importlib.util.find_spec("verl") is None:  # the policy losses and IcePop are verl's
        return {"skipped": "needs verl (scripts/gpu_wheels.sh --rl carries it; Ray is not needed: "
                           "rl.train.verl_import)", "ok": False}
    import torch
    import torch.distributed as dist

    from glm5_mcore.probes.fake_device import assert_collectives_on
    from glm5_mcore.model.mtp_loss import token_logprobs
    from rl.train import algos
    from rl.train.batch import RolloutBatch
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs
    from rl.train.trainer import PolicyTrainer

    dev, hf_dir, cuda = ctx["device"], ctx["hf_dir"], ctx["device"].type == "cuda"
    cfg = RLConfig.from_dict(rl_step_dict(hf_dir, cuda))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (6 + 5 * (i // 2),), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(3, 90, (4,), generator=g).tolist() for _ in range(4)]
    batch = RolloutBatch.build(prompts, responses, [[-1.0] * 4] * 4, [0, 0, 1, 1])
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    seen, bad = [], []
    with assert_collectives_on(dev, seen, bad):
        trainer = PolicyTrainer(cfg, rank=dist.get_rank(), world=dist.get_world_size())
        outs = [None] * dist.get_world_size()
        dist.all_gather_object(outs, trainer.compute_log_probs(batch))
        fill_log_probs(batch, [o for o in outs if o is not None])
        batch.rollout_log_probs = batch.old_log_probs - 0.01
        algos.rollout_correction(cfg, batch)
        algos.compute_advantages(cfg, batch, 0.0)
        trainer.update(batch, step=0)
    out = {"collectives": len(seen), "collective_violations": sorted(set(bad))[:10]}
    m, glm5 = trainer.model, trainer.glm5
    trainer.moe_load.token_mask = None  # the last micro-batch's real-token mask: not this forward's
    ids = torch.randint(3, glm5.vocab_size, (1, 48), generator=g).to(dev)
    targets = torch.randint(3, glm5.vocab_size, (48,), generator=g).to(dev)
    hidden = []
    hook = m.output_layer.register_forward_pre_hook(lambda mod, args: hidden.append(args[0].detach()))
    res = {}
    for name in ("fp32_output_layer", "bf16_logits"):
        hs = m.output_layer._forward_pre_hooks
        saved = dict(hs)
        if name == "bf16_logits":  # drop the trainer's fp32 upcast for the comparison
            for k in [k for k, f in hs.items() if getattr(f, "__name__", "") == "upcast"]:
                del hs[k]
        with torch.no_grad():
            logits = m(input_ids=ids, position_ids=torch.arange(48, device=dev)[None], attention_mask=None)[0]
            res[name] = token_logprobs(logits, targets)[0].double()
        hs.clear()
        hs.update(saved)
    hook.remove()
    h = hidden[-1][:, 0].double()
    ref = torch.log_softmax(h @ m.output_layer.weight.double().T, -1).gather(-1, targets[:, None])[:, 0]
    for name, v in res.items():
        out[f"logprob_max_abs_{name}"] = float((v - ref).abs().max())
    bound = 2e-6 * max(1.0, float(ref.abs().max()))
    out["ok"] = not bad and out["logprob_max_abs_fp32_output_layer"] <= bound
    return out


def stage_resume(ctx: dict) -> dict:
    """4 SFT steps vs 2 + resume + 2, deterministic algorithms on, LoRA dropout on: bitwise equal."""
    if ctx["dry_run"]:
        return {"plan": "SFT 4 steps vs 2 + resume + 2 with torch.use_deterministic_algorithms(True), "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8, LoRA dropout 0.1: losses + optimizer tensors bitwise"}
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import load_plain_tensors

    from glm5_mcore.checkpoint.layout import iter_dir
    from recipes.sft import SFTConfig, run

    cuda, world = ctx["device"].type == "cuda", dist.get_world_size()
    out, data = ctx["out_dir"] / "resume", _data(ctx["out_dir"] / "r.jsonl", 48)
    dist_opt = cuda and world > 1

    def cfg(name, steps):
        return SFTConfig.from_dict({
            "model": {"hf_dir": ctx["hf_dir"]},
            "data": {"train": data, "micro_batch_tokens": 64, "global_batch_tokens": 64 * world * 2, "max_tokens": 48},
            "lora": {"rank": 4, "dropout": 0.1}, "optim": {"lr": 1e-3, "decay_style": "constant", "distributed": dist_opt},
            "train": {"steps": steps, "save_every": 2, "keep_last": 0, "eval_every": 0, "out": str(out / name),
                      "progress": False, "bf16": cuda}, "wandb": {"mode": "disabled"}})

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        full = [h["loss"] for h in run(cfg("a", 4))["history"]]
        run(cfg("b", 2))
        resumed = [h["loss"] for h in run(cfg("b", 4))["history"]]
    finally:
        torch.use_deterministic_algorithms(was)
    a = load_plain_tensors(str(iter_dir(out / "a", 4) / "optimizer" / "dist"))
    b = load_plain_tensors(str(iter_dir(out / "b", 4) / "optimizer" / "dist"))
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    differ = [k for k in tensors if not torch.equal(a[k], b[k])]
    return {"optimizer": "distributed" if dist_opt else "replicated", "losses_full": full, "losses_resumed": resumed,
            "state_tensors": len(tensors), "differ": differ[:5],
            "ok": resumed == full[2:] and not differ and bool(tensors)}


def stage_te_vllm(ctx: dict) -> dict:
    """What needs Transformer Engine and vLLM: printed with the commands; run when both import."""
    have = all(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "vllm"))
    if ctx["dry_run"] or not have:
        return {"plan" if ctx["dry_run"] else "skipped": "needs Transformer Engine and vLLM (not carried): "
                + "; ".join(f"{k}: {v}" for k, v in TE_VLLM.items()), "commands": TE_VLLM}
    import subprocess

    res = {}
    for name in ("te_forward", "vllm_engine"):
        left = ctx["deadline"] - time.monotonic()
        if left < 30:
            res[name] = "skipped: deadline"
            continue
        r = subprocess.run(TE_VLLM[name], shell=True, cwd=ROOT, capture_output=True, text=True, timeout=left)
        res[name] = {"rc": r.returncode, "tail": r.stdout[-400:]}
    return {"runs": res, "ok": all(isinstance(v, dict) and v["rc"] == 0 for v in res.values())}


STAGES = [("env", 20, stage_env), ("model_sft", 70, stage_model_sft), ("rl_step", 60, stage_rl_step),
          ("grouped_lora", "gpu_check_grouped.py", None), ("dsa", "gpu_check_dsa.py", None),
          ("resume", 90, stage_resume),
          ("colocate", "gpu_check_colocate.py", None), ("fp8_base", "gpu_check_fp8.py", None),
          ("vllm_lora", "gpu_check_vllm_lora.py", None), ("te_vllm", 20, stage_te_vllm)]
"""(name, budget seconds or the file of another helper's stage, function), in order of value."""


def load_stages() -> list[tuple[str, int, object, str]]:
    """[(name, budget_s, stage function or None, source)]; an external file absent: function None."""
    out = []
    for name, budget, fn in STAGES:
        if fn is not None:
            out.append((name, budget, fn, "bench/gpu_check.py"))
            continue
        path = Path(__file__).with_name(budget)
        if not path.is_file():
            out.append((name, 0, None, f"bench/{budget} (absent)"))
            continue
        spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.append((name, int(mod.BUDGET_S), mod.stage, f"bench/{budget}"))
    return out


def run_stage(name: str, budget: int, fn, ctx: dict) -> dict:
    """One stage within its budget and the deadline: its JSON record."""
    left = ctx["deadline"] - time.monotonic()
    rec = {"stage": name, "budget_s": budget}
    if fn is None:
        return {**rec, "ok": True, "skipped": "stage file absent"}
    if not ctx["dry_run"] and budget > left:
        return {**rec, "ok": True, "skipped": "deadline", "left_s": round(left, 1)}
    t0 = time.monotonic()
    try:  # interrupted at its own budget (a first TileLang JIT must not eat the later stages) or the deadline
        with _alarm(0 if ctx["dry_run"] else min(left, budget or left)):
            res = fn(ctx)
        rec.update(res)
        rec.setdefault("ok", True)
    except StageTimeout as e:
        rec.update(ok=False, error=f"StageTimeout: {e}")
    except Exception as e:  # noqa: BLE001 - a failed stage is a finding: keep going to the next one
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}",
                   where=traceback.format_exc().strip().splitlines()[-3:-1])
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline-s", type=float, default=600.0, help="stop cleanly this many seconds after the start")
    ap.add_argument("--dry-run", action="store_true", help="walk every stage, print the plan and budget, touch no GPU")
    ap.add_argument("--only", default=None, help="comma-separated stage names")
    ap.add_argument("--hf-dir", default=None, help="an HF GLM-5 folder (default: a tiny one written to --out)")
    ap.add_argument("--out", default=None, help="folder for the stages' files (default: a new temp folder)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    import torch

    stages = load_stages()
    if a.only:
        want = set(a.only.split(","))
        unknown = want - {s[0] for s in stages}
        if unknown:
            ap.error(f"--only: unknown stage(s) {sorted(unknown)}; stages: {[s[0] for s in stages]}")
        stages = [s for s in stages if s[0] in want]
    made = a.out is None
    out_dir = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rank0 = True
    if not a.dry_run:
        import torch.distributed as dist

        from glm5_mcore.mcore_settings import ParallelConfig
        from glm5_mcore.model.parallel import init_parallel

        init_parallel(ParallelConfig())  # sets this rank's CUDA device (LOCAL_RANK) first
        rank0 = dist.get_rank() == 0
    from glm5_mcore.device import training_device

    dev = torch.device("cpu") if a.dry_run else training_device()
    hf_dir = a.hf_dir
    if hf_dir is None and not a.dry_run:
        from glm5_mcore.tiny import write_tiny

        hf_dir = str(write_tiny(out_dir / f"tiny{os.environ.get('LOCAL_RANK', '')}", seed=0))
    ctx = {"device": dev, "deadline": t_start + a.deadline_s, "dry_run": a.dry_run, "out_dir": out_dir,
           "hf_dir": hf_dir}
    total = sum(b for _, b, fn, _ in stages if fn is not None)
    if rank0:
        print(json.dumps({"plan": [{"stage": n, "budget_s": b, "source": src} for n, b, _, src in stages],
                          "budget_s": total, "deadline_s": a.deadline_s, "fits": total <= a.deadline_s}), flush=True)
    results = {}
    for name, budget, fn, _ in stages:
        rec = run_stage(name, budget, fn, ctx)
        results[name] = rec
        if rank0:
            print(json.dumps(rec, default=str), flush=True)
    if made and not a.dry_run:
        shutil.rmtree(out_dir, ignore_errors=True)
    summary = {"device": str(dev), "dry_run": a.dry_run, "deadline_s": a.deadline_s, "budget_s": total,
               "wall_s": round(time.monotonic() - t_start, 1),
               "stages": {k: {"ok": v.get("ok"), **({"skipped": v["skipped"]} if "skipped" in v else {})}
                          for k, v in results.items()},
               "targets": {"every stage": "ok", "logprob_max_abs_fp32_output_layer": "<= 2e-6 * max(1, max |log p|)",
                           "resume": "losses and optimizer tensors bitwise equal"},
               "all_ok": all(v.get("ok") for v in results.values())}
    if rank0:
        print(json.dumps(summary), flush=True)
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
