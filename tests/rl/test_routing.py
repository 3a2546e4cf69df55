"""Rollout Routing Replay (R3, ``rl.train.routing``) on a tiny GLM-5, in-process: routes travel from the HF
engine with each sample, the trainer replays them with Megatron-Core's ``RouterReplay``, and
``rollout_corr/router_agree`` shows routing mismatch."""

import numpy as np
import pytest
import torch

from rl.train import algos
from rl.train.batch import fill_log_probs, make_batch
from rl.train.routing import index_metrics, router_metrics

from tests.support.rl_setup import perturb, perturbed_router_engine, rl_cfg, rollout




@pytest.fixture(scope="module")
def setup(tiny_dir):
    from transformers import AutoTokenizer

    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    cfg = rl_cfg(tiny_dir, rollout={"temperature": 0.8, "max_new_tokens": 12},
               algorithm={"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}})
    trainer = PolicyTrainer(cfg)
    perturb(trainer)
    payload = trainer.export_adapter(1)
    engine = HFRolloutEngine(tiny_dir, index_row_stride=3)
    engine.load_adapter(payload)
    return cfg, trainer, engine, payload, AutoTokenizer.from_pretrained(tiny_dir)


def _log_probs(trainer, batch, replay):
    trainer.routing.replay = replay
    try:
        out = trainer.compute_log_probs(batch)
    finally:
        trainer.routing.replay = False
    fill_log_probs(batch, [out])
    return out


def test_routes_travel_with_samples_and_replay_is_exact_on_same_weights(setup):
    """Same weights in fp32: routes uint8 [P + n - 1, moe_layers, top_k]; replay on/off gives the same old
    log-probs (<= 1e-6) and router agreement 1.0. (The reference policy replays the policy's routes, so its
    log-probs legitimately move: the base model would route some tokens differently.)"""
    cfg, trainer, engine, _, tok = setup
    prompts, results = rollout(cfg, engine, tok, n=2, count=4)
    g = trainer.glm5
    L = sum(g.moe_layer_pattern)
    for p, r in zip([p for p in prompts for _ in range(2)], results):
        assert r.routes.dtype == np.uint8 and r.routes.shape == (len(p.ids) + len(r.response_ids) - 1, L,
                                                                 g.num_experts_per_tok)
        assert all(len(set(row)) == g.num_experts_per_tok for row in r.routes.reshape(-1, g.num_experts_per_tok))
    batch = make_batch(prompts, results, 2)
    off = _log_probs(trainer, batch, False)
    on = _log_probs(trainer, batch, True)
    assert router_metrics([off]) == {"rollout_corr/router_agree": 1.0}
    assert index_metrics([off]) == {"rollout_corr/index_topk_agree": 1.0}
    assert sum(len(r.index_topk[0]) for r in results) >= 20  # sampled rows with a real top-k choice
    assert float(off["index_topk_agree"][1]) >= 20
    assert router_metrics([on]) == {"rollout_corr/router_agree": 1.0}
    m = batch.response_mask.bool()
    assert float((on["old_log_probs"] - off["old_log_probs"]).abs().max()) <= 1e-6
    assert torch.isfinite(on["ref_log_probs"]).all()
    assert float((on["old_log_probs"][m] - batch.rollout_log_probs[m]).abs().max()) <= 1e-5


def test_replay_follows_a_mismatched_engine(setup, tiny_dir):
    """An engine whose routers are perturbed: agreement < 1 without replay; with replay the trainer's
    routing map is exactly the engine's experts, and rollout_corr/kl and mean |Δ log p| drop."""
    from megatron.core.transformer.moe.router import TopKRouter

    cfg, trainer, _, payload, tok = setup
    engine = perturbed_router_engine(tiny_dir)
    engine.load_adapter(payload)
    prompts, results = rollout(cfg, engine, tok, step=1, n=2, count=4)
    batch = make_batch(prompts, results, 2)
    figures = {}
    maps = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: maps.append(out[1])) for r in trainer.model.modules()
             if isinstance(r, TopKRouter)]
    try:
        for replay in (False, True):
            maps.clear()
            out = _log_probs(trainer, batch, replay)
            met = algos.rollout_correction(cfg, batch)
            met.update(router_metrics([out]))
            met.update(index_metrics([out]))
            figures[replay] = {k: met[k] for k in ("rollout_corr/router_agree", "rollout_corr/index_topk_agree",
                                                   "rollout_corr/kl",
                                                   "rollout_corr/logprob_abs_diff_mean",
                                                   "rollout_corr/rollout_is_oob_ratio")}
            old_maps = maps[: len(hooks)]  # the first micro-batch's old-log-prob forward, one map per MoE layer
    finally:
        for h in hooks:
            h.remove()
    print("R3 figures (replay off, on):", figures)
    assert figures[False]["rollout_corr/router_agree"] < 0.99
    assert figures[True]["rollout_corr/router_agree"] < 0.99  # own choices (given the replayed upstream) still differ
    assert figures[False]["rollout_corr/index_topk_agree"] < figures[True]["rollout_corr/index_topk_agree"]
    assert figures[True]["rollout_corr/kl"] < figures[False]["rollout_corr/kl"]
    assert (figures[True]["rollout_corr/logprob_abs_diff_mean"]
            < figures[False]["rollout_corr/logprob_abs_diff_mean"])
    assert figures[True]["rollout_corr/rollout_is_oob_ratio"] < figures[False]["rollout_corr/rollout_is_oob_ratio"]
    # replayed routing maps == the engine's experts on every token that has engine routes
    mb = trainer._micro_batches(batch, list(range(batch.size)))[0]
    for j, rmap in enumerate(old_maps):
        eng = torch.zeros_like(rmap).scatter_(1, mb.routes[:, j], True)
        assert torch.equal(rmap[mb.routes_valid], eng[mb.routes_valid]), j


def test_replay_does_not_change_which_parameters_get_gradients(setup):
    cfg, trainer, engine, _, tok = setup
    n = cfg.rollout.n
    prompts, results = rollout(cfg, engine, tok, step=2, n=n, count=2)
    batch = make_batch(prompts, results, n)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    algos.rollout_correction(cfg, batch)
    batch.scores = torch.arange(batch.size, dtype=torch.float32)
    algos.compute_advantages(cfg, batch, 0.0)
    got = {}
    for replay in (False, True):  # Adam moves exactly the parameters that got a non-zero gradient
        before = {n: p.detach().clone() for n, p in trainer.ddp.named_parameters()}
        trainer.routing.replay = replay
        try:
            met = trainer.update(batch, step=0)
        finally:
            trainer.routing.replay = False
        assert met["actor/updates_skipped"] == 0
        got[replay] = {n for n, p in trainer.ddp.named_parameters() if not torch.equal(p, before[n])}
    assert got[False] and all("lora" in n for n in got[False]) and got[True] == got[False]
