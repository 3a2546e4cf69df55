"""Dynamic micro-batches (``rl.train.micro_batch``, verl's ``use_dynamic_bsz``): the plan fits the token budget,
balances DP ranks and gives every rank the same count; the loss (token-mean, seq-mean-token-mean) is the
same under any split of a mini-batch into micro-batches at DP 1 and DP 2; a sample longer than the budget
is refused with one line; the forward-only passes use their own budget."""

import random

import pytest
import torch

from rl.train import algos
from rl.train.batch import RolloutBatch
from rl.train.micro_batch import plan_micro_batches
from tests.support.rl_setup import perturb, rl_cfg


def _long_tail(n: int, seed: int = 0) -> list[int]:
    """Sample lengths: 90 % of 20..64 tokens, 10 % of 65..1024 (one of each kind at least)."""
    rng = random.Random(seed)
    out = [rng.randint(20, 64) if rng.random() < 0.9 else rng.randint(65, 1024) for _ in range(n - 2)]
    return out + [1024, 20]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_plan_fits_the_budget_balances_ranks_and_counts_agree(dp):
    """Every sample once, every micro-batch within the budget, the same number of micro-batches on every
    rank, no more than the in-order greedy packing needed; DP token totals closer than round-robin's."""
    from glm5_mcore.data.order import greedy_packs

    lengths = _long_tail(64)
    for budget in (1024, 1500, 4096):
        plan = plan_micro_batches(lengths, budget, dp)
        assert len(plan) == dp and len({len(p) for p in plan}) == 1
        assert sorted(j for p in plan for g in p for j in g) == list(range(len(lengths)))
        assert all(sum(lengths[j] for j in g) <= budget for p in plan for g in p)
        if dp == 1:
            assert len(plan[0]) <= len(list(greedy_packs(lengths, budget)))
            assert len(plan[0]) >= -(-sum(lengths) // budget)
        sizes = [[sum(lengths[j] for j in g) for g in p] for p in plan]
        assert all(s == sorted(s, reverse=True) for s in sizes)  # largest first: micro-batch i alike on all ranks
    if dp > 1:
        totals = [sum(lengths[j] for g in p for j in g) for p in plan_micro_batches(lengths, 4096, dp)]
        rr = [sum(lengths[r::dp]) for r in range(dp)]
        assert max(totals) - min(totals) < max(rr) - min(rr), (totals, rr)


def _batch(n: int = 12, R: int = 24, seed: int = 0) -> RolloutBatch:
    """``n`` samples (prompt 3..9 tokens, response 1..R), some response tokens masked, one sample fully
    masked, with advantages, old / reference log-probs and IcePop-like weights."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (int(torch.randint(3, 10, (), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(3, 100, (int(torch.randint(1, R + 1, (), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    b = RolloutBatch.build(prompts, responses, [[-1.0] * len(r) for r in responses], [i // 2 for i in range(n)])
    b.response_mask = b.response_mask * (torch.rand(b.response_mask.shape, generator=g) > 0.15)
    b.response_mask[3] = 0
    shape = b.response_mask.shape
    b.old_log_probs = -torch.rand(shape, generator=g) * 3
    b.ref_log_probs = b.old_log_probs - 0.1 * torch.rand(shape, generator=g)
    b.advantages = torch.randn(shape, generator=g)
    b.rollout_is_weights = 0.5 + torch.rand(shape, generator=g)
    return b


def _splits(lengths: list[int], dp: int) -> list[list[list[list[int]]]]:
    """Plans ``[dp][k][rows]``: the planner's at several budgets, every sample alone, and random ones."""
    n = len(lengths)
    plans = [plan_micro_batches(lengths, b, dp) for b in (max(lengths), 2 * max(lengths), 10 ** 6)]
    plans.append([[[i] for i in range(n)][r::dp] for r in range(dp)])
    rng = random.Random(dp)
    for _ in range(3):
        rows = list(range(n))
        rng.shuffle(rows)
        plan = []
        for r in range(dp):
            s = rows[r::dp]
            cuts = sorted(rng.sample(range(1, len(s)), min(3, len(s) - 1)))
            plan.append([s[a:b] for a, b in zip([0] + cuts, cuts + [len(s)])] + [[]])  # and a filler one
        plans.append(plan)
    return plans


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_loss_is_the_same_under_any_split_at_dp1_and_dp2(tiny_dir, mode):
    """The update's loss terms and gradient (policy loss with rollout-correction weights, entropy bonus,
    KL loss), each micro-batch as ``PolicyTrainer._train_step`` takes it — ``ActorLoss`` × num_micro,
    Megatron's schedule / num_micro, DDP's mean over DP ranks — and the reported metrics (weighted mean of
    every report), equal those of one micro-batch on one rank to 1e-6 under any split."""
    cfg = rl_cfg(tiny_dir, actor={"loss_agg_mode": mode, "use_kl_loss": True, "kl_loss_coef": 0.1,
                                  "entropy_coeff": 0.01})
    loss_fn = algos.ActorLoss(cfg)
    batch = _batch()
    g = torch.Generator().manual_seed(1)
    logp0 = batch.old_log_probs + 0.2 * torch.randn(batch.old_log_probs.shape, generator=g)
    ent0 = torch.rand(logp0.shape, generator=g)
    mask = batch.response_mask
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]

    def run(plan):
        dp = len(plan)
        gbi = {"dp_size": dp, "batch_num_tokens": int(mask.sum()), "global_batch_size": int((mask.sum(-1) > 0).sum())}
        logp, ent = logp0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
        sums, weights = {}, {}
        total = 0.0
        for micro in plan:
            k = len(micro)
            for rows in micro:
                loss, m = loss_fn(batch, rows, logp[rows], ent[rows], None, gbi, k)
                total = total + (loss * k) / k / dp  # x num_micro (loss_func), / num_micro (schedule), DDP mean
                for key, (v, w) in m.items():
                    sums[key], weights[key] = sums.get(key, 0.0) + v * w, weights.get(key, 0.0) + w
        total.backward()
        return float(total.detach()), logp.grad, ent.grad, {k: sums[k] / weights[k] for k in sums}

    ref = run([[list(range(batch.size))]])
    assert ref[1].abs().sum() > 0 and ref[2].abs().sum() > 0
    for dp in (1, 2):
        for plan in _splits(lengths, dp):
            got = run(plan)
            assert abs(got[0] - ref[0]) <= 1e-6, (dp, plan, got[0], ref[0])
            for a, b in ((got[1], ref[1]), (got[2], ref[2])):
                assert float((a - b).abs().max()) <= 1e-6, (dp, plan, float((a - b).abs().max()))
            for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
                assert abs(got[3][k] - ref[3][k]) <= 1e-6, (dp, plan, k, got[3][k], ref[3][k])


SECTIONS = {"rollout": {"n": 2, "temperature": 1.0, "max_new_tokens": 24}, "data": {"prompts_per_step": 4},
            "actor": {"ppo_mini_batch_size": 4, "lr": 1e-3}}


def _trained(hf_dir, **sections):
    """A one-rank trainer, its perturbed adapter (full (A, B) per module) and a filled, corrected batch
    of 8 samples (2 per prompt, responses of up to 24 tokens)."""
    from transformers import AutoTokenizer

    from glm5_mcore.lora.apply import lora_layers
    from rl.train.batch import fill_log_probs, make_batch
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer
    from tests.support.rl_setup import rollout

    cfg = rl_cfg(hf_dir, **sections)
    trainer = PolicyTrainer(cfg)
    perturb(trainer)
    adapter = {lora.module_name: lora.full("default") for _, _, lora in lora_layers(trainer.model)}
    engine = HFRolloutEngine(hf_dir)
    engine.load_adapter(trainer.export_adapter(1))
    prompts, results = rollout(cfg, engine, AutoTokenizer.from_pretrained(hf_dir), n=2, count=4, t=1.0)
    batch = make_batch(prompts, results, 2)
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    return cfg, trainer, batch, adapter


MTP_SECTIONS = {**SECTIONS, "actor": {**SECTIONS["actor"], "mtp_loss_scale": 0.3}}


@pytest.fixture(scope="module")
def trained(tiny_dir):
    return _trained(tiny_dir, **SECTIONS)


@pytest.fixture(scope="module")
def trained_mtp(tiny_mtp_dir):
    """As ``trained``, with the MTP layer and its loss on (``actor.mtp_loss_scale`` 0.3)."""
    return _trained(tiny_mtp_dir, **MTP_SECTIONS)


def _set_budgets(trainer, update, log_prob=None):
    trainer.cfg.actor.micro_batch_tokens, trainer.cfg.actor.log_prob_micro_batch_tokens = update, log_prob


def _budgets(batch) -> tuple[int, int, int]:
    """One micro-batch, about four, one sample each (the longest sample's length)."""
    longest = max(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    return 4096, 2 * longest, longest


def _split_budgets(trainer, batch) -> tuple[int, ...]:
    """Budgets giving 1, 2 and 4 micro-batches (the largest such) and one per sample."""
    rows = list(range(batch.size))
    longest = max(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    total = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    found = {}
    try:
        for b in range(total, longest - 1, -1):
            _set_budgets(trainer, b)
            found.setdefault(len(trainer._micro_batches(batch, rows)), b)
    finally:
        _set_budgets(trainer, 4096)
    assert {1, 2, 4} <= set(found), found
    return found[1], found[2], found[4], longest


MTP_KEYS = ("mtp/loss", "mtp_loss/depth_1", "mtp_accept/depth_1")


def _close(got: dict, ref: dict, what, keys=()) -> float:
    """The largest relative difference of the loss terms, the gradient norm and ``keys`` (≤ 1e-6)."""
    worst = 0.0
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", *keys):
        rel = abs(got[k] - ref[k]) / max(abs(ref[k]), 1.0)
        assert rel <= 1e-6, (what, k, got[k], ref[k])
        worst = max(worst, rel)
    return worst


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_trainer_update_is_the_same_under_dynamic_splits(trained, mode):
    """``PolicyTrainer.update`` (one mini-batch) from the same adapter at budgets giving 1 to 8
    micro-batches: the same loss terms and gradient norm (≤ 1e-6 relative)."""
    from tests.workers.rl_dynmb_check import updates

    cfg, trainer, batch, adapter = trained
    trainer.cfg.actor.loss_agg_mode = mode
    try:
        out = {b: m for b, (m, _) in updates(trainer, {"batch": batch, "adapter": adapter,
                                                       "budgets": _budgets(batch)}).items()}
    finally:
        _set_budgets(trainer, 4096)
        trainer.cfg.actor.loss_agg_mode = "token-mean"
    one, some, each = _budgets(batch)
    counts = {b: m["actor/micro_batches"] for b, m in out.items()}
    assert counts[one] == 1 and counts[each] > counts[some] > 1, counts
    for b, m in out.items():
        assert m["actor/micro_batch_fill"] == 1.0  # one rank: nothing to equalise
        _close(m, out[one], b)


def test_trainer_update_with_mtp_is_the_same_under_splits(trained_mtp):
    """The MTP loss on (``actor.mtp_loss_scale`` 0.3): the update from the same adapter split into 1, 2 and 4
    micro-batches and one per sample gives the same loss terms, gradient norm (the MTP layer's adapters'
    included) and ``mtp/loss`` (≤ 1e-6 relative; printed: the largest). Was: Megatron's per-micro-batch mean
    scaled by 1/k, so the MTP term changed with the split (``actor/grad_norm`` 0.70518 at 2 micro-batches
    against 0.70505 at 1)."""
    from tests.workers.rl_dynmb_check import updates

    cfg, trainer, batch, adapter = trained_mtp
    budgets = _split_budgets(trainer, batch)
    try:
        out = {b: m for b, (m, _) in updates(trainer, {"batch": batch, "adapter": adapter, "budgets": budgets}).items()}
    finally:
        _set_budgets(trainer, 4096)
    counts = [out[b]["actor/micro_batches"] for b in budgets]
    assert counts[:3] == [1, 2, 4] and counts[3] == batch.size, counts
    assert out[budgets[0]]["mtp/loss"] > 0
    worst = max(_close(out[b], out[budgets[0]], (b, c), MTP_KEYS) for b, c in zip(budgets, counts))
    print(f"MTP update invariance over splits {counts}: max relative difference {worst:.2e}")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_trainer_update_with_recompute_equals_without(trained_mtp, tiny_mtp_dir, mode):
    """``trainer.recompute`` on the CPU (was refused: "needs CUDA"): the update with the MTP loss on, in one
    micro-batch and one per sample, gives the loss terms, gradient norm and ``mtp/loss`` of the trainer
    without recompute (≤ 1e-6 relative). The old log-probs (an eval forward) are bit for bit the update's
    forward's at the same weights: under selective recompute both take the unabsorbed DSA core (was: eval
    the absorbed one, 1e-7 apart in fp32, a bf16 rounding apart on a GPU)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from rl.train.trainer import PolicyTrainer
    from tests.workers.rl_dynmb_check import updates

    cfg, trainer, batch, adapter = trained_mtp
    case = {"batch": batch, "adapter": adapter, "budgets": (4096, _budgets(batch)[2])}
    try:
        ref = updates(trainer, case)
    finally:
        _set_budgets(trainer, 4096)
    recomputing = PolicyTrainer(rl_cfg(tiny_mtp_dir, **MTP_SECTIONS, trainer={"recompute": mode}))
    assert recomputing.model.config.recompute_granularity == mode
    for b, (m, _) in updates(recomputing, case).items():
        _close(m, ref[b][0], (mode, b), MTP_KEYS)
    mb = recomputing._micro_batches(batch, list(range(batch.size)))[0]
    with torch.no_grad():
        lp = {}
        for train in (False, True):
            recomputing.ddp.train(train)
            lp[train] = recomputing._logprobs(recomputing.ddp, mb, cfg.rollout.temperature)[0]
    MTPLossLoggingHelper.clean_metrics_in_tracker()  # the training-mode forward logged its MTP loss
    assert torch.equal(lp[False], lp[True]), float((lp[False] - lp[True]).abs().max())


@pytest.mark.slow
def test_trainer_update_at_dp2_equals_dp1_under_dynamic_splits(trained, trained_mtp, tmp_path):
    """DP 2 (gloo ``torchrun``, one launch for both): at each budget both ranks run the same number of
    micro-batches (with fillers where a rank has fewer samples) and the update's loss terms and gradient
    norm — with the MTP loss on, its ``mtp/loss`` too — equal one rank's with one micro-batch (≤ 1e-6
    relative)."""
    from tests.support.launch import torchrun
    from tests.workers.rl_dynmb_check import updates

    cases, refs = [], []
    for (cfg, trainer, batch, adapter), sections in ((trained, SECTIONS), (trained_mtp, MTP_SECTIONS)):
        case = {"batch": batch, "adapter": adapter, "budgets": _budgets(batch)}
        try:
            refs.append(updates(trainer, {**case, "budgets": case["budgets"][:1]})[4096][0])
        finally:
            _set_budgets(trainer, 4096)
        cases.append({**case, "cfg": {"model": {"hf_dir": cfg.model.hf_dir}, "wandb": {"mode": "disabled"},
                                      **sections, "trainer": {"world_size": 2}}})
    torch.save(cases, tmp_path / "cases.pt")
    torchrun("rl_dynmb_check.py", tmp_path / "cases.pt", tmp_path / "out.pt")
    for two, ref, keys in zip(torch.load(tmp_path / "out.pt", weights_only=False), refs, ((), MTP_KEYS)):
        fills = {}
        for b, (m, counts) in two.items():
            assert len(set(counts)) == 1 and m["actor/micro_batches"] == counts[0], (b, counts)
            fills[b] = m["actor/micro_batch_fill"]
            _close(m, ref, b, keys)
        assert min(fills.values()) < 1.0, fills  # equalising padding / fillers exercised
        print({b: (c, round(m["actor/micro_batch_fill"], 3)) for b, (m, c) in two.items()})


def test_log_prob_pass_has_its_own_budget_and_the_same_log_probs(trained):
    """``actor.log_prob_micro_batch_tokens`` packs the forward-only passes (here smaller than the update's
    budget: more forwards), with the same old / reference log-probs per sample."""
    cfg, trainer, batch, _ = trained
    rows = list(range(batch.size))
    longest = max(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    try:
        _set_budgets(trainer, 4096)
        one = trainer.compute_log_probs(batch)
        _set_budgets(trainer, 4096, longest)
        assert len(trainer._micro_batches(batch, rows)) == 1
        assert len(trainer._micro_batches(batch, rows, forward_only=True)) > 2
        split = trainer.compute_log_probs(batch)
    finally:
        _set_budgets(trainer, 4096)
    order = [split["rows"].index(i) for i in one["rows"]]
    for k in ("old_log_probs", "ref_log_probs"):
        diff = float((split[k][order] - one[k]).abs().max())
        assert diff <= 1e-5, (k, diff)


def test_a_sample_longer_than_the_budget_is_refused_naming_the_field(trained):
    """Was: packed alone into a micro-batch past the budget (a long response ran out of memory there)."""
    cfg, trainer, batch, _ = trained
    i = max(range(batch.size), key=lambda j: len(batch.prompts[j]) + len(batch.responses[j]))
    n = len(batch.prompts[i]) + len(batch.responses[i])
    try:
        _set_budgets(trainer, n - 1)
        with pytest.raises(ValueError, match=rf"^actor.micro_batch_tokens={n - 1}: sample {i} has "
                                             rf"{len(batch.prompts[i])} prompt \+ {len(batch.responses[i])} "
                                             rf"response tokens; a sample is never split .* at least {n} "):
            trainer.update(batch, step=0)
        _set_budgets(trainer, 4096, n - 1)
        with pytest.raises(ValueError, match=rf"^actor.log_prob_micro_batch_tokens={n - 1}: sample {i} "):
            trainer.compute_log_probs(batch)
    finally:
        _set_budgets(trainer, 4096)


@pytest.mark.parametrize("key,hint", [
    ("ppo_max_token_len_per_gpu", "verl's name; here actor.micro_batch_tokens"),
    ("log_prob_max_token_len_per_gpu", "verl's name; here actor.log_prob_micro_batch_tokens"),
    ("max_tokens_per_micro_batch", "here actor.micro_batch_tokens"),
    ("use_dynamic_bsz", "always on here"),
])
def test_verl_micro_batch_keys_name_ours(tiny_dir, key, hint):
    from glm5_mcore.training.schema import ConfigError

    with pytest.raises(ConfigError, match=rf"^config: unknown field actor.{key} \({hint}"):
        rl_cfg(tiny_dir, actor={key: 8192})


@pytest.mark.parametrize("field", ["micro_batch_tokens", "log_prob_micro_batch_tokens"])
def test_a_budget_below_one_is_refused(tiny_dir, field):
    with pytest.raises(ValueError, match=rf"actor.{field}=0 must be >= 1"):
        rl_cfg(tiny_dir, actor={field: 0})
