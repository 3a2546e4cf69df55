"""``bench/gpu_check.py`` stage: colocated RL on one GPU (issue 30), tiny widths, the HF engine (the lent
machine's image has no vLLM).

The trainer (``rl.train.trainer.PolicyTrainer``, ``rollout.colocate`` with ``offload_weights``) and the HF engine
share the device in this one process; ``rl.schedule.colocate.Colocation`` runs its real sequence (offload → wake
weights → push → wake KV → generate → sleep → restore) over in-process stand-ins for the Ray groups, for
``STEPS`` steps. Figures: CUDA memory (allocated) before the first offload, after the trainer's offload,
after the engine's sleep, after the restore; the bytes each moved; the step time and each call's time.
Checks: the offload frees at least the trainer's gradient + frozen-weight bytes, the restore brings the
allocation back to within 1 MiB, the engine's sleep frees its weights, losses stay finite, and a
``rl.rollout.weight_sync.CudaIPC`` bucket opened in a second process reads back bit-identical (the CUDA-IPC call
the CPU tests leave to this stage).

Contract (``bench/gpu_check.py``): ``BUDGET_S``; ``stage(ctx)`` with ctx ``device``, ``deadline``
(``time.monotonic()``), ``dry_run``, ``out_dir``. Alone: ``python bench/gpu_check_colocate.py`` (CPU: the
same sequence, no memory figures).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUDGET_S = 90
STEPS = 3
MIB = float(1 << 20)


class _Trainers:
    """``rl.cluster.trainer_group.TrainerGroup``'s ``call`` for one in-process rank."""

    def __init__(self, trainer):
        self.trainer = trainer

    def call(self, method: str, *args):
        return [getattr(self.trainer, method)(*args)]


class _Engines:
    """``rl.cluster.rollout_pool.RolloutPool``'s colocation calls for one in-process engine."""

    def __init__(self, engine):
        self.engine = engine

    def wake_up(self, tags):
        return [self.engine.wake_up(tuple(tags))]

    def sleep(self, level):
        return [self.engine.sleep(level)]

    def sync(self, payload):
        self.engine.load_adapter(payload)
        return [self.engine.last_push()]


def _cuda_ipc_round_trip() -> dict:
    """A bucket of mixed dtypes exported as CUDA IPC handles and read in a spawned process
    (``rl.rollout.weight_sync.round_trip``: its child is a library function, so spawn can pickle it)."""
    import torch

    from rl.rollout import weight_sync as ws

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16).cuda(),
               "b.weight": torch.randn(48, 16, generator=g).to(torch.float8_e4m3fn).cuda(),
               "b.weight_scale_inv": torch.rand(1, 1, generator=g).cuda()}
    return ws.round_trip(tensors, "cuda_ipc")


def rl_dict(hf_dir: str, cuda: bool) -> dict:
    """The stage's RL config (``tests/gpu/test_gpu_path.py`` validates it as on a GPU): bf16 with a GPU per rank."""
    return {"model": {"hf_dir": hf_dir}, "wandb": {"mode": "disabled"},
            "rollout": {"n": 2, "max_new_tokens": 8, "num_actors": 1,
                        "colocate": {"enable": True, "offload_weights": True}},
            "data": {"prompts_per_step": 4}, "actor": {"ppo_mini_batch_size": 4},
            "trainer": {"bf16": cuda, "backend": "local", "gpus_per_rank": 1 if cuda else 0}}


def stage(ctx: dict) -> dict:
    if ctx.get("dry_run"):
        return {"plan": f"colocated trainer + HF engine on one device, {STEPS} RL steps: memory after offload / "
                        "sleep / restore, step time; a CUDA-IPC weight-sync bucket read in a second process"}
    import torch
    from transformers import AutoTokenizer

    from glm5_mcore.tiny import write_tiny
    from rl.train import algos
    from rl.schedule.colocate import Colocation
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs, make_batch
    from glm5_mcore.device import device_memory
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.tasks.prompts import toy_prompts
    from rl.train.trainer import PolicyTrainer

    out_dir = Path(ctx["out_dir"])
    cuda = torch.cuda.is_available()
    hf_dir = str(write_tiny(out_dir / "tiny_colocate", seed=0))
    cfg = RLConfig.from_dict(rl_dict(hf_dir, cuda))
    trainer = PolicyTrainer(cfg)
    engine = HFRolloutEngine(hf_dir, dtype="bfloat16" if cuda else "float32")
    coloc = Colocation(cfg, _Trainers(trainer), _Engines(engine))
    tok = AutoTokenizer.from_pretrained(hf_dir)
    params = SamplingParams(1.0, 1.0, 8, (tok.eos_token_id,))
    coloc.push(trainer.export_adapter(0))
    res: dict = {"device": str(ctx.get("device", "cuda" if cuda else "cpu")), "steps": [], "ok": True}
    for step in range(STEPS):
        if time.monotonic() > ctx["deadline"]:
            res["skipped"] = "deadline"
            break
        t0 = time.perf_counter()
        before = device_memory()
        prompts = toy_prompts(tok, 4, seed=step)
        reqs = [Request((p.index, k), p.ids, sample_seed(1, step, p.index, k)) for p in prompts for k in range(2)]
        with coloc.phase():
            results = engine.generate(reqs, params)
            during = device_memory()
        t_gen = time.perf_counter() - t0
        batch = make_batch(prompts, results, 2)
        batch.scores = torch.tensor([float(r.response_ids[0] % 2) for r in results])  # a GRPO signal
        fill_log_probs(batch, [trainer.compute_log_probs(batch)])
        algos.rollout_correction(cfg, batch)
        algos.compute_advantages(cfg, batch, 0.0)
        m = trainer.update(batch, step)
        coloc.push(trainer.export_adapter(step + 1))
        trace = [e for e in coloc.trace if e["phase"] == step]
        off = next(e["out"][0] for e in trace if e["call"] == "trainer.offload_memory")
        back = next(e["out"][0] for e in trace if e["call"] == "trainer.restore_memory")
        slept = next(e["out"][0] for e in trace if e["call"].startswith("engines.sleep"))
        row = {"step": step, "step_s": round(time.perf_counter() - t0, 3), "gen_phase_s": round(t_gen, 3),
               "calls_s": {e["call"]: round(e["seconds"], 4) for e in trace},
               "pg_loss": float(m["actor/pg_loss"]), "offload_grad_mib": off["grad_bytes_freed"] / MIB,
               "offload_weight_mib": off["weight_bytes"] / MIB, "engine_sleep": slept}
        if cuda:
            row.update(alloc_before_mib=before["allocated_gib"] * 1024, alloc_after_offload_mib=off["allocated_gib"] * 1024,
                       alloc_generating_mib=during["allocated_gib"] * 1024,
                       alloc_after_restore_mib=back["allocated_gib"] * 1024)
            freed = (before["allocated_gib"] - off["allocated_gib"]) * 1024
            row["checks"] = {"offload_freed_grads_and_weights":
                             freed >= 0.99 * (off["grad_bytes_freed"] + off["weight_bytes"]) / MIB,
                             "restore_back_within_1mib": abs(back["allocated_gib"] - before["allocated_gib"]) * 1024 <= 1.0}
            res["ok"] = res["ok"] and all(row["checks"].values())
        res["ok"] = res["ok"] and bool(torch.isfinite(torch.tensor(row["pg_loss"])))
        res["steps"].append(row)
    if cuda and time.monotonic() < ctx["deadline"]:
        res["cuda_ipc"] = _cuda_ipc_round_trip()
        res["ok"] = res["ok"] and res["cuda_ipc"]["ok"]
    (out_dir / "gpu_check_colocate.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    import argparse
    import tempfile

    import torch

    argparse.ArgumentParser(description="bench/gpu_check.py's colocate stage alone (CPU: the same sequence, no "
                                        "memory figures); one JSON line").parse_args()
    with tempfile.TemporaryDirectory() as d:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(json.dumps(stage({"device": dev, "deadline": time.monotonic() + BUDGET_S, "dry_run": False,
                                "out_dir": Path(d)})))
