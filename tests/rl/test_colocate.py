"""Colocated RL (``rl.schedule.colocate``): engines in the trainer's placement-group bundles with fractional
resources, the per-step sequence offload → wake(weights) → push → wake(kv_cache) → generate → sleep →
restore, and the same log-probs and losses as the separate-engine run on the same seeds (HF engine here;
vLLM-CPU in ``tests/rl/test_vllm_cpu.py::test_colocated_vllm_matches_separate``). The trainer's offload is real on
CPU (grad buffers and frozen weights freed and restored), so a wrong restore changes the losses."""

import pytest
import torch

from tests.support.rl_setup import local_ray, ray_run_dict

PHASE = ["trainer.offload_memory", "engines.wake_up(weights)", "engines.push", "engines.wake_up(kv_cache)",
         "engines.generate", "engines.sleep(level=1)", "trainer.restore_memory"]
START = ["trainer.offload_memory", "engines.start", "engines.sleep(level=1)", "trainer.restore_memory"]


def rl_cfg(tiny_dir, out, **sections):
    from rl.config import RLConfig

    return RLConfig.from_dict(rl_dict(tiny_dir, out, **sections))


def rl_dict(tiny_dir, out, **sections) -> dict:
    return ray_run_dict(tiny_dir, out, {
        "data": {"prompts_per_step": 4}, "rollout": {"n": 2, "max_new_tokens": 4, "num_actors": 1},
        "actor": {"ppo_mini_batch_size": 4}, "ray": {"num_cpus": 2}, "trainer": {"steps": 2}}, **sections)


def same_history(a: list, b: list) -> float:
    """max |a - b| over every metric but timings, throughput, the engines' occupancy (live rows / slots averaged
    over wall time), how the pushes travelled (a colocated engine's level-2 sleep brings every weight back) and the
    colocated-only ones."""
    worst = 0.0
    skip = ("timing_s/", "perf/", "colocate/", "rollout/engine_occupancy", "rollout/push_")
    for ra, rb in zip(a, b, strict=True):
        ka = {k for k in ra if not k.startswith(skip)}
        assert ka == {k for k in rb if not k.startswith(skip)}
        for k in ka:
            worst = max(worst, abs(float(ra[k]) - float(rb[k])))
    return worst


@pytest.fixture
def ray_fresh():
    with local_ray():
        yield


@pytest.mark.slow
@pytest.mark.ray
def test_colocated_sequence_and_same_losses_as_separate(tiny_dir, tmp_path, ray_fresh):
    import ray

    from rl.driver import run

    sep = run(rl_cfg(tiny_dir, tmp_path / "sep"))
    ray.shutdown()
    co = run(rl_cfg(tiny_dir, tmp_path / "co", rollout={"colocate": {"enable": True, "offload_weights": True}}))
    trace = co["colocate"]
    phases = sorted({e["phase"] for e in trace})
    assert phases == [-1, 0, 1]  # the engines' start, then one generation phase per step
    assert [e["call"] for e in trace if e["phase"] == -1] == START
    for p in phases[1:]:
        assert [e["call"] for e in trace if e["phase"] == p] == PHASE
    first = trace[0]["out"][0]
    assert first["what"] == ["grad_buffers", "optimizer", "frozen_weights"]
    assert first["grad_bytes_freed"] > 0 and first["weight_bytes"] > 0
    sleeps = [e["out"] for e in trace if e["call"].startswith("engines.sleep")]
    assert all("no-op" in m for out in sleeps for m in out)  # the HF engine on CPU: called and logged
    pushed = [e["out"]["version"] for e in trace if e["call"] == "engines.push"]
    assert pushed == [0, 1]  # step s generates with adapter version s
    assert same_history(sep["history"], co["history"]) == 0.0
    assert co["history"][0]["colocate/offload_bytes"] == float(first["grad_bytes_freed"] + first["weight_bytes"])


def test_sleep_level_by_push_kind_and_config_errors(tiny_dir, tmp_path):
    from rl.schedule.colocate import sleep_level

    assert sleep_level(rl_cfg(tiny_dir, tmp_path)) == 1
    vllm = "rl.rollout.vllm_engine.VLLMRolloutEngine"  # merged pushes: a vLLM setting (the HF engine refuses it)
    merged = rl_cfg(tiny_dir, tmp_path, rollout={"engine": vllm, "engine_kwargs": {"merge": True}})
    assert sleep_level(merged) == 2
    forced = rl_cfg(tiny_dir, tmp_path, rollout={"engine": vllm, "engine_kwargs": {"merge": True},
                                                 "colocate": {"sleep_level": 1}})
    assert sleep_level(forced) == 1
    for sections, field in (({"trainer": {"off_policy_steps": 1}}, "off_policy_steps"),
                            ({"rollout": {"num_actors": 3}}, "num_actors"),
                            ({"rollout": {"gpus_per_actor": 1}}, "gpus_per_actor"),
                            ({"rollout": {"colocate": {"enable": True, "engine_fraction": 1.0}}}, "engine_fraction")):
        sections.setdefault("rollout", {}).setdefault("colocate", {})["enable"] = True
        with pytest.raises(ValueError, match=field):
            rl_cfg(tiny_dir, tmp_path, **sections)


def test_trainer_offload_restores_bit_identical_and_trains_the_same(tiny_dir, tmp_path):
    """In process: offload + restore between two updates leaves the same weights and losses as none."""
    from rl.train.batch import fill_log_probs, make_batch
    from rl.rollout.base import Result
    from rl.tasks.prompts import toy_prompts
    from rl.train.trainer import PolicyTrainer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = toy_prompts(tok, 4, seed=0)
    g = torch.Generator().manual_seed(0)
    results = [Result((p.index, k), torch.randint(5, 60, (3,), generator=g).tolist(), [-1.0] * 3)
               for p in prompts for k in range(2)]

    def two_updates(colocate: bool):
        cfg = rl_cfg(tiny_dir, tmp_path, rollout={"colocate": {"enable": colocate, "offload_weights": True}})
        tr = PolicyTrainer(cfg)
        losses = []
        for step in range(2):
            if colocate:
                tr.offload_memory()
                assert all(p.untyped_storage().nbytes() == 0 for p in tr.model.parameters() if not p.requires_grad)
                tr.restore_memory()
            batch = make_batch(prompts, results, 2)
            batch.scores = torch.arange(8, dtype=torch.float32) % 3
            fill_log_probs(batch, [tr.compute_log_probs(batch)])
            from rl.train import algos

            algos.compute_advantages(cfg, batch, 0.0)
            losses.append(tr.update(batch, step)["actor/pg_loss"])
        return losses, [p.detach().clone() for p in tr.model.parameters()]

    l0, w0 = two_updates(False)
    l1, w1 = two_updates(True)
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


class _ZeroingEngines:
    """A ``RolloutPool`` of one engine whose weights are zeroed by ``sleep(2)`` (vLLM's level 2 keeps only
    buffers: gpu_worker.py:298-311) and set by each push; ``generate`` records the weights it runs on."""

    def __init__(self):
        self.weights = torch.zeros(4)
        self.ran_on: list[float] = []

    def sleep(self, level):
        if level == 2:
            self.weights.zero_()
        return [f"sleep({level})"]

    def wake_up(self, tags):
        return [f"wake_up({list(tags)})"]

    def nodes(self):
        return ["here"]

    def sync(self, payload):
        self.weights.fill_(float(payload.version))
        return [{"version": payload.version}]

    def generate(self, requests, params):
        from rl.rollout.base import Result

        self.ran_on.append(float(self.weights[0]))
        return [Result(r.key, [5], [-1.0], "length") for r in requests]


class _Trainers:
    def call(self, method, *args):
        return [{"grad_bytes_freed": 0, "weight_bytes": 0}]


def test_level2_wake_up_restores_the_weights_after_an_evaluation(tiny_dir, tmp_path):
    """G4: merged pushes sleep at level 2; a held-out evaluation between two steps takes the pending push, and
    the next step's wake-up must still bring the weights back (the push again), not generate on what level 2
    discarded. Driver order: first adapter → eval (step 0) → step 0 → push v1 → eval → step 1."""
    from types import SimpleNamespace

    from rl.driver import Cluster, held_out_reward
    from rl.rollout.base import AdapterPayload, Request, SamplingParams
    from rl.schedule.colocate import Colocation

    cfg = rl_cfg(tiny_dir, tmp_path, rollout={"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine",
                                              "engine_kwargs": {"merge": True}, "colocate": {"enable": True}})
    engines = _ZeroingEngines()
    coloc = Colocation.start(cfg, _Trainers(), lambda: engines)
    assert coloc.level == 2
    cluster = Cluster(_Trainers(), engines, coloc, {})
    source = SimpleNamespace(settle=lambda: None)
    val = [SimpleNamespace(index=0, ids=[3, 4, 5])]
    rewards = lambda prompts, results, n: torch.tensor([1.0])  # noqa: E731
    sampling = SamplingParams(1.0, 1.0, 1, (2,))

    def step_generation():
        with cluster.phase():
            engines.generate([Request((0, 0), [3, 4], 1)], sampling)

    cluster.push_first(AdapterPayload(7, {"adapter_model.safetensors": b""}))
    held_out_reward(cfg, cluster, source, rewards, val, sampling, 0)
    step_generation()
    coloc.push(AdapterPayload(8, {"adapter_model.safetensors": b""}))  # train_step's push after the update
    held_out_reward(cfg, cluster, source, rewards, val, sampling, 1)
    step_generation()
    step_generation()
    assert engines.ran_on == [7.0, 7.0, 8.0, 8.0, 8.0], engines.ran_on  # never the discarded (zero) weights
    pushes = [(e["phase"], e["call"], e["out"]["version"]) for e in coloc.trace if e["call"].startswith("engines.push")]
    assert pushes == [(0, "engines.push", 7), (1, "engines.push(restore)", 7), (2, "engines.push", 8),
                      (3, "engines.push(restore)", 8), (4, "engines.push(restore)", 8)], pushes
