"""``glm5 plan``: the planner against real GLM-5 744B ranks built on the fake backend, the activation
formula against a measured forward+backward, the shipped 744B configs, the gate, the CLI."""

import json
import math

import pytest

from tests.support.launch import REPO, glm5, torchrun


OLD_RL_744B = {  # configs/rl/glm5_744b.yaml before the planner: TP 8 x EP 8 trainer, bf16 engines on 8 GPUs
    "data": {"max_prompt_tokens": 2048},
    "rollout": {"engine_kwargs": {"tensor_parallel_size": 8, "max_lora_rank": 16, "merge": True},
                "num_actors": 4, "gpus_per_actor": 8, "n": 16, "max_new_tokens": 8192},
    "actor": {"micro_batch_tokens": 16384},
    "trainer": {"world_size": 64, "tp": 8, "ep": 8, "bf16": True},
}


def _run_check(script: str, *args: str, timeout: int = 600) -> list[dict]:
    # a fresh process group: not the rendezvous of this pytest process (init_parallel sets MASTER_PORT)
    out = torchrun(script, *args, nproc=1, timeout=timeout, cwd=REPO)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_planner_equals_built_744b_ranks():
    """Per rank, the planner's parameter, weight, buffer, gradient, main-parameter and Adam bytes equal
    those of the real model built for that rank (and Megatron DDP's gradient buffers over it), at TP 8
    EP 8, EP 64, PP 2 (first stage; last stage with MTP), PP 13 (a middle stage), ETP 8, and sampled
    ranks of the two shipped 744B layouts; and the frozen FP8 base (``model.base_dtype=fp8``: e4m3 bytes + 128x128
    block scales as ``BlockFP8Weight`` holds them) on the shipped RL rank and both PP 2 stages (MTP on the last),
    each the same built rank with its base swapped in place."""
    rows = _run_check("plan_check.py")
    assert {r["case"] for r in rows} >= {"rl_old_tp8_ep8", "ep64_full_ft", "pp2_ep64_lora", "pp13_ep16_full_ft",
                                         "etp8_ep8_full_ft", "shipped_rl", "shipped_sft",
                                         "shipped_rl_fp8", "pp2_ep64_lora_fp8"}
    for r in rows:
        b, p, what = r["built"], r["plan"], f"{r['case']} rank {r['rank']}"
        for k in ("params", "param_bytes", "expert_params", "trainable", "buffer_bytes"):
            assert b[k] == p[k], f"{what}: {k} built {b[k]} planned {p[k]}"
        plain = r["buffers_dist0"]
        assert all(x["numel"] == x["numel_unpadded"] for x in plain)
        assert sum(x["numel"] * x["grad_bytes"] for x in plain) == p["grads"], what
        assert sum(x["numel"] for x in plain) == p["trainable"], what
        assert sum(4 * x["numel"] for x in plain if x["grad_bytes"] == 2) == p["main_params"], what
        assert sum(8 * x["numel"] for x in plain) == p["optimizer"], what
        dist = r["buffers_dist1"]
        shard = lambda x: math.ceil(x["numel_unpadded"] / x["dp"])  # noqa: E731
        assert sum(8 * shard(x) for x in dist) == p["optimizer_dist"], what
        assert sum(4 * shard(x) for x in dist if x["grad_bytes"] == 2) == p["main_params_dist"], what
        for x in dist:  # Megatron pads each buffer to the DP size: a few elements per shard
            assert 0 <= x["numel"] // x["dp"] - shard(x) <= 1e-3 * shard(x) + 64
    by = {(r["case"], r["rank"]): r for r in rows}
    for case, rank in (("shipped_rl", 37), ("pp2_ep64_lora", 127)):  # 1 byte + scales: half the bf16 rank's bytes
        fp8, bf16 = by[(f"{case}_fp8", rank)], by[(case, rank)]
        assert fp8["base_fp8"] and not bf16["base_fp8"] and fp8["built"]["params"] == bf16["built"]["params"]
        assert 0.51 < fp8["built"]["param_bytes"] / bf16["built"]["param_bytes"] < 0.53, (case, fp8, bf16)
    assert by[("rl_old_tp8_ep8", 0)]["built"]["param_bytes"] > 189e9  # the old RL layout: 190 GB per GPU
    first, last = by[("pp2_ep64_lora", 0)], by[("pp2_ep64_lora", 127)]
    assert last["built"]["params"] > first["built"]["params"]  # MTP layer + its embedding copy


@pytest.mark.slow
def test_activation_formula_against_measured_peak():
    """The activation formula within 15% of torch's MemTracker peak (activations + temporaries) of a
    real forward+backward at two scaled-down GLM-5 widths on CPU."""
    rows = _run_check("activation_check.py")
    assert len(rows) == 2
    for r in rows:
        assert 0.85 <= r["ratio"] <= 1.15, r


def _compose(name, overrides=()):
    from recipes.cli import compose

    return compose(name, list(overrides), require_all=False)


@pytest.mark.parametrize("name", ["rl/glm5_744b", "rl/glm5_744b_h100_colocate", "sft_glm5_744b_lora"])
def test_shipped_744b_configs_fit_their_cluster(name):
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job, sft_job
    from recipes.plan_cli import plan_config
    from glm5_mcore.plan.planner import plan_job

    d = _compose(name)
    cluster = cluster_from(d["plan"]["cluster"])
    job = (rl_job(plan_config("rl", d)) if name.startswith("rl/")
           else sft_job(plan_config("sft", d), cluster.num_gpus))
    plan = plan_job(glm5_744b(), job, cluster)
    assert plan.fits, plan.problems
    assert job.trainer_gpus + job.rollout_gpus <= cluster.num_gpus
    if job.rollout is not None:
        assert plan.engine.sequences >= job.rollout.n


def test_gate_refuses_old_rl_layout_with_numbers_and_nearest():
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.gate import check_job
    from glm5_mcore.plan.job import rl_job
    from recipes.plan_cli import plan_config

    job = rl_job(plan_config("rl", OLD_RL_744B))
    with pytest.raises(ValueError) as e:
        check_job(glm5_744b(), job, cluster_from("h100:12"))
    msg = str(e.value)
    assert "does not fit" in msg and "weights 190.0 GB" in msg and "90.6B routed experts" in msg
    assert "rollout engine (8 GPUs): weights do not fit" in msg
    assert "smallest rollout engine that fits" in msg and "quantization=fp8" in msg
    # the same layout with a micro-batch that fits: the nearest trainer layout is EP 64 on 64 GPUs
    job = rl_job(plan_config("rl", {**OLD_RL_744B, "actor": {"micro_batch_tokens": 4096}}))
    with pytest.raises(ValueError, match=r"nearest trainer layout that fits: world 64, TP 8, EP (32|64)"):
        check_job(glm5_744b(), job, cluster_from("h100:12"))
    with pytest.warns(UserWarning, match="does not fit"):  # plan.check=false: a warning, the plan
        plan = check_job(glm5_744b(), job, cluster_from("h100:12"), check=False)
    assert not plan.fits


def test_gate_is_off_on_cpu_and_plan_section_parses():
    import torch

    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.gate import gate
    from glm5_mcore.plan.job import rl_job
    from recipes.plan_cli import plan_config
    from recipes.sft import SFTConfig
    from rl.config import RLConfig

    if not torch.cuda.is_available():
        assert gate(glm5_744b(), rl_job(plan_config("rl", OLD_RL_744B)), "h100:12", True) is None
    assert RLConfig.from_dict({"plan": {"cluster": "h200:12", "check": False}}).plan.check is False
    assert SFTConfig.from_dict({"plan": {"check": False}}).plan.check is False
    with pytest.raises(ValueError, match="plan.check must be true or false"):
        RLConfig.from_dict({"plan": {"check": "no"}})


def test_rollout_kv_cache_per_token_by_hand():
    """MLA latent (512 + 64) x 2 bytes x 78 layers + the FP8 indexer key (128 + a 4-byte scale) x 78."""
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.rollout import EngineSpec, kv_bytes_per_token

    assert kv_bytes_per_token(glm5_744b(), EngineSpec(tp=8)) == 78 * 576 * 2 + 78 * 132
    assert kv_bytes_per_token(glm5_744b(), EngineSpec(tp=8, pp=2)) == (78 * 576 * 2 + 78 * 132) // 2


def _glm5(*args):
    return glm5(*args, ok=False, timeout=300, cwd=REPO)


@pytest.mark.slow
def test_glm5_plan_cli_shipped_config():
    out = _glm5("plan", "--config", "rl/glm5_744b")
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["plan"]["fits"] and last["plan"]["rollout_engine"]["weights"] == "fp8"


def test_glm5_plan_search(capsys):
    from recipes.main import main

    assert main(["plan", "--config", "rl/glm5_744b", "trainer.ep=8"]) == 1  # the old trainer layout
    out = capsys.readouterr().out
    assert "verdict: does not fit" in out and "(weights 191.4 GB)" in out  # the base 190.0 + the full-stack adapters
    spelled = main(["plan", "--config", "glm5_744b", "trainer.ep=8"]), capsys.readouterr().out  # glm5 rl's spelling
    assert spelled == (main(["plan", "--config", "rl/glm5_744b", "trainer.ep=8"]), capsys.readouterr().out)
    assert spelled[1].startswith("rl job on ")

    rc = main(["plan", "--kind", "sft", "--cluster", "h100:8", "--tp", "8", "--ep", "8", "--micro-batch-tokens",
               "4096", "--search"])
    out = capsys.readouterr().out
    assert rc == 1 and "verdict: does not fit" in out and "feasible trainer layouts" in out
    found = json.loads(out.strip().splitlines()[-1])["search"]
    assert found and found[0]["world"] <= 64 and found[0]["fullest_gib"] <= 74
    assert [f["world"] for f in found] == sorted(f["world"] for f in found)


def test_glm5_plan_cli_bad_input(capsys):
    from recipes.main import main

    assert main(["plan", "--cluster", "a100"]) == 2
    assert capsys.readouterr().err.startswith("glm5 plan: error: cluster: unknown preset 'a100'")
    assert main(["plan", "--kind", "sft", "--cluster", "h100", "--world", "24", "--tp", "3"]) == 2
    assert "tp: num_attention_heads=64 is not divisible by tp=3" in capsys.readouterr().err
    assert main(["plan", "--config", "no_such_config"]) == 2
    assert "no_such_config.yaml: missing" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--world=0", "--tp=0", "--ep=0", "--micro-batch-tokens=0",
                                  "--micro-batch-tokens=-5", "--gpus-per-node=0", "--host-mem-gib=0"])
def test_glm5_plan_refuses_zero_and_negative_sizes(capsys, flag):
    """Issue 34 class 10: a size of 0 was read as "not given" (``if getattr(args, dim)``) and -5 planned as
    "fits"; each is now one line naming the flag, exit 2."""
    from recipes.main import main

    assert main(["plan", "--kind", "sft", "--cluster", "h100:8", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"glm5 plan: error: {flag}: must be >= 1", err


def test_engine_gpus_must_match_the_actor_reservation():
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job
    from recipes.plan_cli import plan_config
    from glm5_mcore.plan.planner import plan_job

    d = _compose("rl/glm5_744b", ["rollout.gpus_per_actor=16"])
    plan = plan_job(glm5_744b(), rl_job(plan_config("rl", d)), cluster_from("h200:12"))
    assert not plan.fits and any("rollout.gpus_per_actor=16 but the engine spans" in p for p in plan.problems)


def test_a_vocabulary_tp_does_not_divide_is_planned_padded():
    """154881 tokens (GLM-5's plus one added): the search still offers TP 8 (it kept only TPs dividing the
    vocabulary: TP 1), and the embedding and output layer are planned at the padded 154888 rows / 8 per rank,
    19456 with Megatron-LM's make_vocab_size_divisible_by=128 (what the built rank holds: test above)."""
    import dataclasses

    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.job import Job
    from glm5_mcore.plan.layout import Layout
    from glm5_mcore.plan.params import stage_tensors
    from glm5_mcore.plan.search import candidate_layouts

    m = dataclasses.replace(glm5_744b(), vocab_size=154881)
    job = Job(kind="sft", layout=Layout(64, tp=8, ep=8), micro_batch_tokens=4096)
    assert 8 in {L.tp for L in candidate_layouts(m, job, 64, 8)}
    for divisible_by, rows in ((1, 154888 // 8), (128, 155648 // 8)):
        L = Layout(64, tp=8, ep=8, make_vocab_size_divisible_by=divisible_by)
        groups = {g.name: g for g in stage_tensors(m, L, 0, mtp=True)}
        assert groups["embedding"].total == groups["output_layer"].total == rows * m.hidden_size


def test_glm5_plan_has_a_dsa_row_for_every_indexer_stage(capsys):
    """Issue 43 item 5: ``glm5 plan`` shows one DSA layer's peak in each training stage of the indexer (the
    planner's ``dsa_core_peak``: frozen, the sparse KL, the THD warm-up), marks the job's stage (read from
    ``train.freeze_indexer`` / ``train.indexer_warmup``) and sizes the job's activations with it: the sparse
    KL keeps the indexer's outputs and its fp32 target per layer, the warm-up SDPA's [s, T] bias."""
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.activations import DSA_STAGES, dsa_core_peak
    from glm5_mcore.plan.layout import Layout
    from recipes.main import main

    base = ["plan", "--config", "sft_glm5_744b_lora", "data.micro_batch_tokens=32768", "data.max_tokens=32768"]
    want = {s: round(dsa_core_peak(glm5_744b(), Layout(world=64, tp=8, ep=64), 32768, 2, stage=s) / 2**30, 2)
            for s in DSA_STAGES}
    acts = {}
    # the preset adapts the indexer (lora=full_stack), so it trains it: sparse+loss unless frozen
    for stage, label, extra in (("sparse", "sparse", ["lora=default", "train.freeze_indexer=true"]),
                                ("sparse_loss", "sparse+loss", []), ("warmup", "warm-up", ["train.indexer_warmup=true"])):
        main(base + extra)
        out = capsys.readouterr().out
        rank = json.loads(out.strip().splitlines()[-1])["plan"]["ranks"][0]
        assert rank["dsa_layer_peak_gib"] == want, (rank["dsa_layer_peak_gib"], want)
        assert f"DSA layer: {label} (job)" in out and out.count("(job)") == 1, out
        acts[stage] = rank["activations_no_recompute_gib"]
    assert acts["sparse"] < acts["sparse_loss"] < acts["warmup"], acts
