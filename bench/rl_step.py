"""One GRPO step on the tiny GLM-5, split by phase, plus rollout batching and weight-sync costs.

Measured in-process (the trainer rank and one rollout engine in this process, no Ray, so the
numbers are the work itself), on the tiny model:

1. step time split over ``--steps`` steps: rollout, reward, old log-probs, reference log-probs
   (adapters disabled), advantages, update, weight sync (PEFT export + engine load);
2. rollout tokens/s with all of a step's prompts batched vs one prompt at a time (same requests,
   same seeds: the same tokens come out);
3. weight sync of the adapter (HF PEFT payload) vs the full merged weights (peft merge on a copy,
   safetensors bytes, ``load_state_dict`` into the engine's model): bytes and seconds on the tiny
   model; bytes computed for the 744B architecture (adapter from the meta-device model's shapes, fp32
   as exported; merged weights bf16).

4. one-step-off-policy overlap (``trainer.off_policy_steps=1``) vs synchronous: the real Ray driver
   (``rl.driver.run``) on the quickstart shape (``configs/rl/grpo_tiny``: 16 prompts x 8 samples, 2
   rollout actors, 1 trainer rank), ``--overlap-repeats`` pairs of runs in this process (ABBA order),
   medians over the steps after ``--overlap-warmup`` of each run; the ideal is the synchronous runs' sum
   of phases over their max (rollout vs everything else), target >= 80% of it; phase medians of both modes
   side by side and the load average before / after (on a shared machine other work skews both).

Usage: .venv/bin/python bench/rl_step.py [--steps 3] [--prompts 16] [--n 8] [--max-new 16] [--no-744b]
       [--overlap-steps 10] [--overlap-warmup 2] [--overlap-repeats 1] [--overlap-only]
       (--overlap-steps 0: skip part 4)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--no-744b", action="store_true")
    p.add_argument("--overlap-steps", type=int, default=10)
    p.add_argument("--overlap-warmup", type=int, default=2)
    p.add_argument("--overlap-actors", type=int, default=2, help="rollout actors (quickstart: 2)")
    p.add_argument("--overlap-repeats", type=int, default=1, help="pairs of sync / overlap runs (ABBA order)")
    p.add_argument("--overlap-only", action="store_true")
    a = p.parse_args()
    if a.overlap_only:
        print(json.dumps(overlap_bench(a.overlap_steps, a.overlap_warmup, a.overlap_actors, a.overlap_repeats)))
        return
    import torch

    torch.set_num_threads(1)
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save
    from transformers import AutoTokenizer

    from glm5_mcore.tiny import write_tiny
    from rl.train import algos
    from rl.config import RLConfig
    from rl.tasks.step_rewards import Rewards
    from rl.train.batch import fill_log_probs, make_batch
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.tasks.prompts import next_prompts, toy_prompts
    from rl.train.trainer import PolicyTrainer

    tmp = tempfile.mkdtemp()
    hf = str(write_tiny(f"{tmp}/tiny"))
    cfg = RLConfig.from_dict({"model": {"hf_dir": hf}, "wandb": {"mode": "disabled"},
                              "data": {"prompts_per_step": a.prompts},
                              "rollout": {"n": a.n, "max_new_tokens": a.max_new},
                              "actor": {"ppo_mini_batch_size": a.prompts // 2}})
    tok = AutoTokenizer.from_pretrained(hf)
    trainer, engine = PolicyTrainer(cfg), HFRolloutEngine(hf)
    rewards, prompts_all, pos = Rewards(cfg, tok), toy_prompts(tok, 512, 0), {"epoch": 0, "cursor": 0}
    params = SamplingParams(1.0, 1.0, a.max_new, ())  # no stop token: every response is max_new long
    engine.load_adapter(trainer.export_adapter(0))
    phases = ["rollout", "reward", "old_log_prob", "ref_log_prob", "advantages", "update", "weight_sync"]
    tot = dict.fromkeys(phases, 0.0)
    for step in range(a.steps):
        t = {}
        t0 = time.perf_counter()
        prompts = next_prompts(prompts_all, a.prompts, 0, pos)
        reqs = [Request((q.index, k), q.ids, sample_seed(0, step, q.index, k)) for q in prompts for k in range(a.n)]
        results = engine.generate(reqs, params)
        t["rollout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = make_batch(prompts, results, a.n)
        batch.scores = rewards(prompts, results, a.n)
        t["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.compute_log_probs(batch, ref=False)
        t["old_log_prob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=True)])
        t["ref_log_prob"] = time.perf_counter() - t0 - t["old_log_prob"]
        t0 = time.perf_counter()
        algos.rollout_correction(cfg, batch)
        algos.compute_advantages(cfg, batch, 0.0)
        t["advantages"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.update(batch, step)
        t["update"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        payload = trainer.export_adapter(step + 1)
        engine.load_adapter(payload)
        t["weight_sync"] = time.perf_counter() - t0
        if step:  # step 0 warms caches
            for k in phases:
                tot[k] += t[k]
    steps = max(1, a.steps - 1)
    total = sum(tot.values())
    print(f"GRPO step on tiny GLM-5: {a.prompts} prompts x {a.n} samples x {a.max_new} new tokens, "
          f"mean of {steps} step(s) after a warm-up step")
    print(f"{'phase':<14} {'seconds':>9} {'share':>7}")
    for k in phases:
        print(f"{k:<14} {tot[k] / steps:>9.3f} {tot[k] / total:>7.1%}")

    # rollout batching
    reqs = [Request((q.index, k), q.ids, sample_seed(0, 99, q.index, k)) for q in prompts for k in range(a.n)]
    t0 = time.perf_counter()
    batched = engine.generate(reqs, params, batched=True)
    tb = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = engine.generate(reqs, params, batched=False)
    ts = time.perf_counter() - t0
    same = [r.response_ids for r in batched] == [r.response_ids for r in single]
    ntok = sum(len(r.response_ids) for r in batched)
    print(f"\nrollout: {ntok} tokens; all prompts batched {ntok / tb:,.0f} tok/s, one prompt at a time "
          f"{ntok / ts:,.0f} tok/s -> {ts / tb:.2f}x (same tokens: {same})")

    # weight sync: adapter vs full merged weights
    t0 = time.perf_counter()
    payload = trainer.export_adapter(1000)
    engine.load_adapter(payload)
    t_adapter = time.perf_counter() - t0
    t0 = time.perf_counter()
    merged = copy.deepcopy(engine.peft).merge_and_unload()
    data = st_save({k: v.contiguous() for k, v in merged.state_dict().items()})
    engine.model.load_state_dict(st_load(data), strict=False)
    t_full = time.perf_counter() - t0
    print(f"weight sync (tiny): adapter {payload.nbytes / 1e6:.3f} MB in {t_adapter:.3f}s; full merged weights "
          f"{len(data) / 1e6:.3f} MB in {t_full:.3f}s -> adapter is {len(data) / payload.nbytes:.1f}x fewer bytes, "
          f"{t_full / t_adapter:.1f}x faster")
    out = {"bench": "rl_step", "steps": steps, "phase_s": {k: round(tot[k] / steps, 4) for k in phases},
           "rollout_tok_s_batched": ntok / tb, "rollout_tok_s_single": ntok / ts, "batching_speedup": ts / tb,
           "batched_same_tokens": same, "sync_adapter_bytes": payload.nbytes, "sync_full_bytes": len(data),
           "sync_adapter_s": t_adapter, "sync_full_s": t_full}
    if not a.no_744b:
        import sys

        sys.path.insert(0, os.path.dirname(__file__))
        from lora_memory import count

        from glm5_mcore.config import glm5_744b
        from glm5_mcore.convert.common import meta_model
        from glm5_mcore.lora.config import DEFAULT_TARGETS

        model = meta_model(glm5_744b(), torch.bfloat16)
        full = sum(x.numel() for x in model.parameters())
        n_adapter, _ = count(model, DEFAULT_TARGETS, cfg.lora.rank)
        ab, fb = n_adapter * 4, full * 2
        print(f"weight sync (744B, rank {cfg.lora.rank} default targets): adapter {ab / 1e9:.2f} GB (fp32) vs merged "
              f"weights {fb / 1e12:.2f} TB (bf16) -> {fb / ab:,.0f}x fewer bytes per sync")
        out.update({"sync_744b_adapter_bytes": ab, "sync_744b_full_bytes": fb, "sync_744b_ratio": fb / ab})
    out["targets"] = {"batching_speedup_gt": 1.0, "adapter_fewer_bytes": True}
    out["pass"] = out["batching_speedup"] > 1.0 and payload.nbytes < len(data) and same
    if a.overlap_steps:
        ov = overlap_bench(a.overlap_steps, a.overlap_warmup, a.overlap_actors, a.overlap_repeats)
        out.update({k: v for k, v in ov.items() if k not in ("targets", "pass")})
        out["targets"]["overlap_of_ideal_ge"] = ov["targets"]["overlap_of_ideal_ge"]
        out["pass"] = out["pass"] and ov["pass"]
    print(json.dumps(out))


def overlap_bench(steps: int, warmup: int, actors: int = 2, repeats: int = 1) -> dict:
    """Synchronous vs one-step-off-policy ``rl.driver.run`` on the quickstart shape, ``repeats`` pairs of runs
    in this process (ABBA order: sync, overlap, overlap, sync, ...: a drifting machine load falls on both
    alike). Per mode the median over every step after ``warmup`` of each run: step time, and for the
    synchronous runs the rollout phase (the wait for samples: generation, scoring, packing) and the rest
    (trainer: log-probs, update, adapter export + load; driver). Ideal speedup = (rollout + rest) /
    max(rollout, rest); achieved = synchronous step / overlapped step; target >= 80% of ideal."""
    import statistics

    from glm5_mcore.tiny import write_tiny
    from rl.config import RLConfig
    from rl.driver import run
    from recipes.cli import compose

    tmp = tempfile.mkdtemp()
    hf = str(write_tiny(f"{tmp}/tiny", seed=0))
    load0 = os.getloadavg()
    steps_of: dict[int, list[dict]] = {0: [], 1: []}
    order = [m for r in range(repeats) for m in ((0, 1) if r % 2 == 0 else (1, 0))]
    for i, off in enumerate(order):
        d = compose("rl/grpo_tiny", [f"model.hf_dir={hf}", f"trainer.out={tmp}/rl{i}", f"trainer.steps={steps}",
                                     "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
                                     "wandb.mode=disabled", f"trainer.off_policy_steps={off}",
                                     f"rollout.num_actors={actors}"])
        steps_of[off] += run(RLConfig.from_dict(d))["history"][warmup:]
    load1 = os.getloadavg()

    def med(off, key):
        return statistics.median(h[key] for h in steps_of[off])

    gen = statistics.median(h["timing_s/gen_wait"] for h in steps_of[0])
    rest = statistics.median(h["timing_s/step"] - h["timing_s/gen_wait"] for h in steps_of[0])
    sync_step, ov_step = med(0, "timing_s/step"), med(1, "timing_s/step")
    ideal = (gen + rest) / max(gen, rest)
    speedup = sync_step / ov_step
    phases = {k: {m: round(med(m, f"timing_s/{k}"), 4) for m in (0, 1)}
              for k in ("gen", "gen_wait", "reward", "pack", "old_log_prob", "update_actor", "weight_sync", "step")}
    calls = ("gen_wait", "old_log_prob", "update_actor", "weight_sync")
    phases["driver_serial"] = {m: round(statistics.median(h["timing_s/step"] - sum(h[f"timing_s/{k}"] for k in calls)
                                                          for h in steps_of[m]), 4) for m in (0, 1)}
    print(f"\noverlap (quickstart shape, {actors} rollout actor(s) + 1 trainer rank, {os.cpu_count()} cores, "
          f"{repeats} pair(s) of runs, median of {len(steps_of[0])} + {len(steps_of[1])} steps after {warmup} "
          f"warm-up each; load average {load0[0]:.2f} -> {load1[0]:.2f}):")
    print(f"{'phase (median s)':<18} {'sync':>8} {'overlap':>8}")
    for k, v in phases.items():
        print(f"{k:<18} {v[0]:>8.3f} {v[1]:>8.3f}")
    print(f"synchronous {1 / sync_step:.3f} steps/s (rollout {gen:.3f}s + rest {rest:.3f}s): ideal overlapped step "
          f"{max(gen, rest):.3f}s, ideal speedup {ideal:.3f}x; one-step-off-policy {1 / ov_step:.3f} steps/s "
          f"(step {ov_step:.3f}s) -> {speedup:.3f}x = {speedup / ideal:.0%} of ideal")
    return {"overlap_sync_steps_per_s": 1 / sync_step, "overlap_steps_per_s": 1 / ov_step,
            "overlap_speedup": speedup, "overlap_ideal_speedup": ideal, "overlap_of_ideal": speedup / ideal,
            "overlap_phase_s": {"rollout": gen, "trainer": rest}, "overlap_phases_median_s": phases,
            "overlap_actors": actors, "overlap_repeats": repeats, "overlap_steps_measured": len(steps_of[1]),
            "overlap_staleness": med(1, "rollout/staleness"), "overlap_loadavg": [round(load0[0], 2), round(load1[0], 2)],
            "cores": os.cpu_count(), "targets": {"overlap_of_ideal_ge": 0.8}, "pass": speedup / ideal >= 0.8}


if __name__ == "__main__":
    main()
