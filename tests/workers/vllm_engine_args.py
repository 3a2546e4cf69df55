"""vLLM's own argument checks on a set of ``vllm.LLM`` keyword arguments, under vLLM's interpreter (``.venv-vllm``):
``LLM(**kwargs)`` runs as far as the engine's construction — its offline data-parallel refusal, ``EngineArgs``, and
``create_engine_config`` (model, parallel, quantization, cache configs) — then stops before any worker starts.
argv: a JSON file {"kwargs": [{...}, ...], "ray_site": path or null}; prints one JSON line {"checks": [...]}, one
{"ok", "error" | "parallel"} per keyword set (all checked in this one interpreter: vLLM's import is most of the time).
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
    print(json.dumps({"checks": [check(llm_mod, kwargs) for kwargs in spec["kwargs"]]}))


def check(llm_mod, kwargs: dict) -> dict:
    try:
        llm_mod.LLM(**kwargs)
    except Built as b:
        pc = b.args[0].parallel_config
        return {"ok": True, "parallel": {"tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size,
                                         "dp": pc.data_parallel_size, "world": pc.world_size,
                                         "backend": str(pc.distributed_executor_backend),
                                         "expert_parallel": pc.enable_expert_parallel}}
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the answer
        return {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
    return {"ok": False, "error": "LLM() returned without building its engine"}


if __name__ == "__main__":
    main()
