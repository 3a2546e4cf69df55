"""RL set-ups shared by the RL tests, the GPU tests and ``tests/workers/rl_cp_check.py``: the tiny
model's RL config, a seeded adapter perturbation (so policy != reference), a toy rollout, an engine
whose routers disagree with the trainer's, the MTP layer's merged weights, the observation-token
checks of tool episodes, vLLM's draft-model view of an HF tensor, and the Ray runs' config and local
cluster."""

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from rl.train import algos
from rl.config import RLConfig
from rl.tasks.step_rewards import Rewards
from rl.train.batch import fill_log_probs, make_batch
from rl.rollout.base import Request, SamplingParams, sample_seed
from rl.tasks.prompts import next_prompts, toy_prompts


def rl_cfg(tiny_dir, **sections):
    """The RL config of the tiny model (W&B off), ``sections`` replacing whole top-level sections."""
    d = {"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"}}
    d.update(sections)
    return RLConfig.from_dict(d)


GPU_TRAINER = {"bf16": True, "gpus_per_rank": 1}
"""The trainer section of the GPU tests' configs (bf16 needs a GPU per rank: ``rl.validate``)."""


def gpu_rl_dict(hf_dir, **sections) -> dict:
    """The GPU tests' RL config as a dict (``tests/gpu/test_gpu_vllm.py``; validated on CPU by
    ``tests/gpu/test_gpu_path.py``): W&B off, ``GPU_TRAINER``, ``sections`` merged into their sections."""
    d = {"model": {"hf_dir": str(hf_dir)}, "wandb": {"mode": "disabled"}, "trainer": dict(GPU_TRAINER)}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return d


def ray_run_dict(tiny_dir, out, base: dict, **sections) -> dict:
    """A Ray run's config of the tiny model as a dict: W&B and held-out evaluation off, no progress bar,
    ``trainer.out`` = ``out``; ``base`` then ``sections`` merged into their sections."""
    d = {"model": {"hf_dir": str(tiny_dir)}, "wandb": {"mode": "disabled"}, "data": {"val": None},
         "trainer": {"out": str(out), "progress": False, "eval_every": 0}}
    for part in (base, sections):
        for k, v in part.items():
            d.setdefault(k, {}).update(v)
    return d


@contextmanager
def local_ray(num_cpus=None):
    """A fresh local Ray whose workers import this checkout (``tests.support.rl_fault_engine``): started
    here with ``num_cpus`` when given, else by the job; shut down and the environment restored after
    (``PYTHONPATH``, and what ``ray.init`` sets in it, e.g. ``RAY_AUTH_MODE=token``: a later test's
    ``ray start`` nodes would otherwise inherit token auth their drivers do not have)."""
    import ray

    from rl.cluster.ray_jobs import start_ray

    before = dict(os.environ)
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    ray.shutdown()
    if num_cpus is not None:
        start_ray(None, num_cpus)
    try:
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(before)


def perturb(trainer, name="default", seed=0, scale=0.05):
    """Seeded N(0, scale) into adapter ``name``'s B matrices, so the policy differs from the reference."""
    from glm5_mcore.lora.apply import lora_layers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, lora in lora_layers(trainer.model):
            if name in lora.B:
                lora.B[name].copy_(torch.randn(lora.B[name].shape, generator=g) * scale)


def rollout(cfg, engine, tok, step=0, n=4, count=8, t=None):
    """(prompts, results): ``n`` samples of ``count`` toy prompts (each repeated 4x) from ``engine``."""
    prompts = toy_prompts(tok, count, seed=step)
    for p in prompts:  # longer prompts than index_topk (8): the indexer really selects
        p.ids = p.ids * 4
    reqs = [Request((p.index, k), p.ids, sample_seed(1, step, p.index, k)) for p in prompts for k in range(n)]
    params = SamplingParams(t or cfg.rollout.temperature, 1.0, cfg.rollout.max_new_tokens, (tok.eos_token_id,))
    return prompts, engine.generate(reqs, params)


def rl_steps(cfg, trainer, engine, tok, steps: int, n_prompts: int):
    """Yield (batch, metrics) of ``steps`` in-process RL steps (no Ray): the engine serves the trainer's adapter,
    ``data.prompts_per_step`` of ``n_prompts`` toy prompts get ``rollout.n`` samples each (``rollout.temperature``,
    ``max_new_tokens``), are scored, get the trainer's old log-probs and advantages, then one update."""
    n, per_step = cfg.rollout.n, cfg.data.prompts_per_step
    train = toy_prompts(tok, n_prompts, 0)
    rewards, pos = Rewards(cfg, tok), {"epoch": 0, "cursor": 0}
    params = SamplingParams(cfg.rollout.temperature, 1.0, cfg.rollout.max_new_tokens, (tok.eos_token_id,))
    for step in range(steps):
        engine.load_adapter(trainer.export_adapter(step))
        prompts = next_prompts(train, per_step, 0, pos)
        reqs = [Request((p.index, k), p.ids, sample_seed(0, step, p.index, k)) for p in prompts for k in range(n)]
        results = engine.generate(reqs, params)
        batch = make_batch(prompts, results, n)
        batch.scores = rewards(prompts, results, n)
        fill_log_probs(batch, [trainer.compute_log_probs(batch)])
        algos.rollout_correction(cfg, batch)
        algos.compute_advantages(cfg, batch, 0.0)
        yield batch, trainer.update(batch, step)


def perturbed_router_engine(tiny_dir):
    """The embedded engine (DSA top-k of every 3rd query row recorded) with each MoE router's weight
    moved by 0.3 of its std (seeded), so a measurable fraction of expert choices differ from the trainer's."""
    from rl.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(tiny_dir, index_row_stride=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in engine.model.modules():
            if type(m).__name__ == "GlmMoeDsaTopkRouter":
                m.weight.add_(torch.randn(m.weight.shape, generator=g) * 0.3 * m.weight.std())
    return engine


def trainer_merged_mtp(trainer) -> dict:
    """HF name → W + scale·B·A of every adapted MTP-layer linear, from the trainer's own modules (one
    rank: full tensors), independent of the engines' push path (base shards + the exported PEFT payload)."""
    from glm5_mcore.checkpoint.hf_names import hf_source
    from glm5_mcore.lora.apply import lora_layers

    out = {}
    with torch.no_grad():
        for _, mod, lora in lora_layers(trainer.model):
            if lora.module_name.startswith("mtp."):
                w = mod.weight.float() + lora.local_delta_weight("default").float()
                src = hf_source(lora.module_name + ".weight", trainer.glm5.num_hidden_layers)
                out.update(zip(src.names, w.chunk(2, 0) if src.is_glu else (w,)))
    return out


def observation_positions(results, shape) -> torch.Tensor:
    """[B, R] bool: the observation tokens of each episode (``Result.mask`` 0)."""
    obs = torch.zeros(shape, dtype=torch.bool)
    for i, r in enumerate(results):
        obs[i, : len(r.mask)] = torch.tensor(r.mask) == 0
    return obs


def assert_observations_inert(cfg, prompts, results, n: int, min_obs: int = 12) -> None:
    """Noise on the old / rollout / reference log-probs of observation tokens leaves IcePop's weights, the
    actor loss (PPO + KL loss), its KL metric and every gradient unchanged; observation tokens get none."""
    batch = make_batch(prompts, results, n)
    obs = observation_positions(results, batch.response_mask.shape)
    assert obs.sum() >= min_obs and not (batch.response_mask.bool() & obs).any()
    g = torch.Generator().manual_seed(0)
    lp = batch.rollout_log_probs + 0.1 * torch.randn(batch.rollout_log_probs.shape, generator=g)
    batch.scores = torch.rand(batch.size, generator=g).round()

    def run(noise):
        b = make_batch(prompts, results, n)
        b.scores = batch.scores
        b.old_log_probs, b.ref_log_probs = lp.clone(), lp - 0.2
        b.rollout_log_probs = b.rollout_log_probs.clone()
        if noise:
            for t in (b.old_log_probs, b.ref_log_probs, b.rollout_log_probs):
                t[obs] += 3.0 * torch.randn(int(obs.sum()), generator=torch.Generator().manual_seed(noise))
        algos.rollout_correction(cfg, b)
        algos.compute_advantages(cfg, b, 0.0)
        cur = (lp + 0.05).clone().requires_grad_(True)
        loss, m = algos.ActorLoss(cfg)(b, list(range(b.size)), cur, torch.zeros_like(cur), None,
                                       {"dp_size": 1, "batch_num_tokens": int(b.response_mask.sum()),
                                        "global_batch_size": b.size})
        loss.backward()
        return b.rollout_is_weights * b.response_mask, loss.detach(), m["actor/kl_loss"][0], cur.grad

    w0, l0, kl0, g0 = run(0)
    w1, l1, kl1, g1 = run(7)
    assert torch.equal(w0, w1) and torch.equal(l0, l1) and kl0 == kl1 and torch.equal(g0, g1)
    assert torch.all(g0[obs] == 0) and g0[batch.response_mask.bool()].abs().sum() > 0


def vllm_draft_view(hf: str, draft: dict, q_lora_rank: int):
    """The part of vLLM's draft-model parameters that holds HF tensor ``hf`` (``DeepSeekMTP.load_weights``:
    the layer's decoder block under ``mtp_block.``, q_a + kv_a fused, gate + up fused, routed experts in
    ``w13_weight`` [E, 2I, H] (gate rows, then up) and ``w2_weight`` [E, H, I])."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.weight$", hf)
    pre, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
        return draft[pre + rest + ".weight"]
    blk = pre + "mtp_block."
    if rest == "self_attn.q_a_proj":
        return draft[blk + "self_attn.fused_qkv_a_proj.weight"][:q_lora_rank]
    if rest == "self_attn.kv_a_proj_with_mqa":
        return draft[blk + "self_attn.fused_qkv_a_proj.weight"][q_lora_rank:]
    e = re.match(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$", rest)
    if e:
        i, kind = int(e.group(1)), e.group(2)
        if kind == "down_proj":
            return draft[blk + "mlp.experts.routed_experts.w2_weight"][i]
        w13 = draft[blk + "mlp.experts.routed_experts.w13_weight"][i]
        return w13.chunk(2, 0)[0 if kind == "gate_proj" else 1]
    g = re.match(r"^(mlp(?:\.shared_experts)?)\.(gate_proj|up_proj)$", rest)
    if g:
        return draft[blk + g.group(1) + ".gate_up_proj.weight"].chunk(2, 0)[0 if g.group(2) == "gate_proj" else 1]
    return draft[blk + rest + ".weight"]


def killed_before_last_save(run, last: int, prev: int) -> None:
    """``run`` (a finished run's folder, or a copy of one) as a run killed after step ``last`` was logged,
    before its (final) checkpoint: iteration ``last`` removed, ``latest`` back at ``prev``."""
    from glm5_mcore.checkpoint.layout import iter_dir, write_latest

    shutil.rmtree(iter_dir(run, last))
    write_latest(run, prev)
