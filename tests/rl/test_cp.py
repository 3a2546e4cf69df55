"""Context parallelism in the RL trainer (``trainer.cp``, ``rl.train.cp``): at CP 2 (gloo, ``torchrun
--nproc_per_node 2``) old / reference log-probs, critic values, router / DSA top-k agreement, two PPO
updates' metrics and the trained parameters equal CP 1's, with responses longer than one CP rank's
share of their pack; with router replay each CP rank replays exactly the engine's experts of its tokens."""

import json
import time

import pytest
import torch

from tests.support.rl_setup import perturbed_router_engine, rl_cfg
from tests.support.launch import torchrun


SECTIONS = {"rollout": {"n": 2, "temperature": 1.0, "max_new_tokens": 40},
            "data": {"prompts_per_step": 4},
            "algorithm": {"adv_estimator": "gae", "router_replay": True,
                          "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}},
            "actor": {"ppo_mini_batch_size": 2, "micro_batch_tokens": 64, "lr": 1e-3}}
METRIC_ABS = 1e-6
"""The step metrics are token means of terms of order one (normalised advantages times ratios, log-probs,
value errors) that largely cancel (whitened GAE advantages have mean zero), so ``actor/pg_loss`` is ~1e-2 while its
terms are ~1: CP 2 sums them in another order (and the CPU kernels' vector width, which follows the ISA,
changes the order again), which moves such a mean by up to ~(number of tokens) x 2^-24 x max|term| ≈ 1e-6 of
the terms' scale whatever the mean's own size (seen: -0.0103639811 vs -0.0103638768 on AVX-512, 1.0e-7).
So each metric is held to 1e-5 of itself or 1e-6 absolute, one part in 10^6 of its terms."""


def _batch(cfg, trainer, tiny_dir):
    """A rollout of an engine with perturbed routers (so replay changes the trainer's routing): short
    prompts, responses of up to 40 tokens."""
    from transformers import AutoTokenizer

    from rl.train.batch import make_batch
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.tasks.prompts import toy_prompts

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    engine = perturbed_router_engine(tiny_dir)
    engine.load_adapter(trainer.export_adapter(1))
    prompts = toy_prompts(tok, 4, seed=3)
    for p in prompts:
        p.ids = p.ids * 3  # 9 prompt tokens: past index_topk (8), so the indexer selects
    reqs = [Request((p.index, k), p.ids, sample_seed(1, 0, p.index, k)) for p in prompts for k in range(2)]
    results = engine.generate(reqs, SamplingParams(1.0, 1.0, 40, (tok.eos_token_id,)))
    batch = make_batch(prompts, results, 2)
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    return batch


def _rel(a, b) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.mark.slow
def test_cp2_equals_cp1_with_router_replay(tiny_dir, tmp_path):
    import copy

    from tests.workers.rl_cp_check import build, run

    d = {"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"}, **SECTIONS}
    cfg1 = rl_cfg(tiny_dir, **SECTIONS)
    trainer = build(cfg1)
    batch = _batch(cfg1, trainer, tiny_dir)
    torch.save(batch, tmp_path / "batch.pt")
    init = {n: p.detach().clone() for n, p in trainer.ddp.named_parameters() if p.requires_grad}
    t0 = time.perf_counter()
    one = run(trainer, cfg1, copy.deepcopy(batch))
    t_one = time.perf_counter() - t0

    d2 = json.loads(json.dumps(d))
    d2["trainer"] = {"world_size": 2, "cp": 2}
    (tmp_path / "cfg.json").write_text(json.dumps(d2))
    t0 = time.perf_counter()
    torchrun("rl_cp_check.py", tmp_path / "cfg.json", tmp_path / "batch.pt", tmp_path / "cp2.pt")
    t_two = time.perf_counter() - t0
    two = torch.load(tmp_path / "cp2.pt", weights_only=False)

    resp, local = two["longest_response_vs_local_tokens"]
    assert resp > local, (resp, local)  # a response longer than its pack's share on one CP rank
    figures = {}
    for when in ("off", "on", "after"):
        for k in ("old_log_probs", "ref_log_probs", "values"):
            a, b = two[when][k], one[when][k]
            assert a.shape == b.shape
            figures[f"{when}/{k}"] = (float((a - b).abs().max()), _rel(a, b))
            assert _rel(a, b) <= 1e-5, (when, k, figures[f"{when}/{k}"])
        for k in ("rollout_corr/router_agree", "rollout_corr/index_topk_agree"):
            if when != "after":
                assert two[when][k] == one[when][k], (when, k, two[when][k], one[when][k])
    assert float(one["after"]["values"].abs().max()) > 1e-3  # the critic moved off its zero init
    assert one["off"]["rollout_corr/router_agree"] < 0.99  # the perturbed engine routes differently
    assert two["replay"]["checked"] > 0 and two["replay"]["mismatched"] == 0, two["replay"]
    assert one["replay"]["mismatched"] == 0
    for s, (m1, m2) in enumerate(zip(one["metrics"], two["metrics"])):
        assert m2["actor/updates_skipped"] == 0
        for k, v in m1.items():
            if k.startswith("timing") or not isinstance(v, float):
                continue
            assert m2[k] == pytest.approx(v, rel=1e-5, abs=METRIC_ABS), (s, k, v, m2[k])
    worst = max(((_rel(two["params"][n], p), float((two["params"][n] - p).abs().max()), n)
                 for n, p in one["params"].items()))
    moved = max(float((p - init[n]).abs().max()) for n, p in one["params"].items())
    print(f"CP2 vs CP1: {figures}; params worst rel {worst[0]:.2e} (max abs {worst[1]:.2e}, {worst[2]}); "
          f"longest response {resp} tokens vs {local} local tokens of its pack; "
          f"replay checked {two['replay']}; moe load CP1 {one['metrics'][0].get('moe/max_over_mean')} "
          f"CP2 {two['metrics'][0].get('moe/max_over_mean')}; CP1 run {t_one:.1f}s, CP2 torchrun {t_two:.1f}s")
    assert worst[0] <= 1e-5, worst
    assert moved > 1e-4, moved  # the updates did move the adapters


@pytest.mark.parametrize("trainer,msg", [
    ({"cp": 0}, "trainer.cp=0 must be >= 1"),
    ({"world_size": 2, "cp": 4}, "trainer.cp=4 must be >= 1 with trainer.tp × trainer.cp = 4 dividing "
                                 "trainer.world_size=2"),
    ({"world_size": 4, "tp": 2, "cp": 4}, "trainer.tp × trainer.cp = 8"),
])
def test_bad_cp_is_refused_naming_the_field(tiny_dir, trainer, msg):
    with pytest.raises(ValueError, match=msg.replace("×", ".")):
        rl_cfg(tiny_dir, trainer=trainer)


def test_cp_refuses_the_mtp_loss(tiny_dir):
    with pytest.raises(ValueError, match=r"trainer.cp=2: the MTP loss"):
        rl_cfg(tiny_dir, trainer={"world_size": 2, "cp": 2}, actor={"mtp_accept": True})


def test_cp_shards_cover_the_pack_once():
    """Every token of a pack lands on exactly one CP rank (chunks r and 2·cp-1-r of each padded document),
    and ``cp_unsplit_index`` puts the all-gathered shares back in order."""
    from glm5_mcore.data.cp_split import cp_shard, cp_unsplit_index

    cu = [0, 5, 6, 23, 40]
    for cp, m in ((2, 1), (2, 2), (3, 1), (4, 1)):
        shards = [cp_shard(cu, cp, r, m) for r in range(cp)]
        assert len({s.index.numel() for s in shards}) == 1
        got = torch.cat([s.index for s in shards])
        assert sorted(got[got >= 0].tolist()) == list(range(40))
        assert all(int(n) % (2 * cp * m) == 0 for n in shards[0].cu_seqlens.diff())
        assert torch.equal(got[cp_unsplit_index(cu, cp, m)], torch.arange(40))
    s = cp_shard([0, 8], 2, 1)  # chunks 1 and 2 of 4
    assert s.index.tolist() == [2, 3, 4, 5] and s.cu_seqlens.tolist() == [0, 8]
