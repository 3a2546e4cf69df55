"""vLLM's own argument checks on a set of ``vllm.LLM`` keyword arguments, under vLLM's interpreter (``.venv-vllm``):
``LLM(**kwargs)`` runs as far as the engine's construction — its offline data-parallel refusal, ``EngineArgs``, and
``create_engine_config`` (model, parallel, quantization, cache configs) — then stops before any worker starts.
argv: a JSON file {"kwargs": {...}, "ray_site": path or null}; prints one JSON line {"ok", "error" | "parallel"}.
``ray_site``: a site-packages holding Ray, appended to ``sys.path`` (vLLM checks ``distributed_executor_backend="ray"``
by importing it; ``.venv-vllm`` has none)."""

import json
import sys


class Built(Exception):
    pass


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if spec.get("ray_site"):
        sys.path.append(spec["ray_site"])
    from vllm.entrypoints import llm as llm_mod

    def from_engine_args(engine_args, usage_context=None, **_):
        raise Built(engine_args.create_engine_config(usage_context))

    llm_mod.LLMEngine.from_engine_args = from_engine_args
    try:
        llm_mod.LLM(**spec["kwargs"])
    except Built as b:
        pc = b.args[0].parallel_config
        print(json.dumps({"ok": True, "parallel": {"tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size,
                                                   "dp": pc.data_parallel_size, "world": pc.world_size,
                                                   "backend": str(pc.distributed_executor_backend),
                                                   "expert_parallel": pc.enable_expert_parallel}}))
        return
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the answer
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}))


if __name__ == "__main__":
    main()
