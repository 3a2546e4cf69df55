"""``glm5 plan``: size a job's layout on a cluster before a GPU is rented.

    glm5 plan --model 744b --config rl/glm5_744b            # a shipped config, its own cluster
    glm5 plan --model 744b --config sft_glm5_744b_lora parallel.ep=32 --cluster h100:32
    glm5 plan --hf-dir DIR --kind sft --world 64 --tp 8 --ep 64 --micro-batch-tokens 8192 --search

Last line: one JSON object (the plan, and with ``--search`` the feasible layouts).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from glm5_mcore.config import GLM5Config, glm5_744b

MODELS = {"744b": glm5_744b}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="744b", help=f"preset: {sorted(MODELS)} (ignored with --hf-dir)")
    p.add_argument("--hf-dir", help="an HF GLM-5 folder: its config.json")
    p.add_argument("--config", help="a shipped recipe config: sft_..., or an RL one as rl/NAME or NAME")
    p.add_argument("--kind", choices=["sft", "rl"], help="the job kind (default sft; with --config, of a bare NAME "
                                                          "both configs/ and configs/rl/ hold)")
    p.add_argument("--cluster", help="preset[:nodes], e.g. h100:16 or h200:8 (default: the config's plan.cluster)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--gpu-mem-gib", type=float)
    p.add_argument("--host-mem-gib", type=float, help="a node's RAM (default: the cluster preset's, 2048)")
    p.add_argument("--world", type=int, help="trainer ranks (SFT: default nodes x GPUs per node)")
    for dim in ("tp", "ep", "etp", "pp", "cp"):
        p.add_argument(f"--{dim}", type=int)
    p.add_argument("--micro-batch-tokens", type=int)
    p.add_argument("--search", action="store_true", help="list the feasible layouts with the fewest GPUs")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")


SIZES = ("nodes", "gpus_per_node", "gpu_mem_gib", "host_mem_gib", "world", "tp", "ep", "etp", "pp", "cp",
         "micro_batch_tokens")
"""Sizes given on the command line: each must be >= 1 when given (0 is refused, not read as "not given")."""


def _check_sizes(args) -> None:
    for name in SIZES:
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={v:g}: must be >= 1")


def plan_config(kind: str, d: dict):
    """The typed config (``SFTConfig`` / ``RLConfig``) the planner reads, from a composed dict whose ``???``
    values (fields the plan does not need, e.g. ``data.train``) take the schema's defaults."""
    from glm5_mcore.training.schema import build
    from recipes.sft_config import SFTConfig
    from rl.config import RLConfig

    def given(x):
        return {k: given(v) for k, v in x.items() if v != "???"} if isinstance(x, dict) else x

    return build(RLConfig if kind == "rl" else SFTConfig, given(d))


def _job_from_args(args):
    from glm5_mcore.plan.job import rl_job, sft_job

    _check_sizes(args)
    d = {}
    kind = args.kind or "sft"
    if args.config:
        from recipes.cli import compose, shipped_config  # the configs are the recipes'; Hydra stays at the entry point

        name = shipped_config(args.config, args.kind)  # rl/NAME or NAME
        kind = "rl" if name.startswith("rl/") else "sft"
        d = compose(name, list(args.overrides), require_all=False)
    elif args.overrides:
        raise ValueError("key=value overrides need --config")
    from glm5_mcore.plan.cluster import cluster_from

    cluster = cluster_from(args.cluster or (d.get("plan") or {}).get("cluster"), args.nodes, args.gpus_per_node,
                           args.gpu_mem_gib, args.host_mem_gib)
    if kind == "rl":
        if args.world is not None:
            d.setdefault("trainer", {})["world_size"] = args.world
        for dim in ("tp", "ep"):
            if getattr(args, dim) is not None:
                d.setdefault("trainer", {})[dim] = getattr(args, dim)
        job = rl_job(plan_config("rl", d))
    else:
        for dim in ("tp", "ep", "pp", "cp"):
            if getattr(args, dim) is not None:
                d.setdefault("parallel", {})[dim] = getattr(args, dim)
        if args.micro_batch_tokens is not None:
            d.setdefault("data", {})["micro_batch_tokens"] = args.micro_batch_tokens
            d["data"].setdefault("global_batch_tokens", args.micro_batch_tokens)
        if not d.get("train"):
            d["train"] = {"bf16": True}
        job = sft_job(plan_config("sft", d), args.world if args.world is not None else cluster.num_gpus,
                      etp=args.etp)
    if kind == "rl" and args.micro_batch_tokens is not None:
        job = replace(job, micro_batch_tokens=args.micro_batch_tokens)
    return job, cluster


def run(args) -> int:
    from glm5_mcore.plan.planner import plan_job
    from glm5_mcore.plan.report import format_layout_row, format_plan
    from glm5_mcore.plan.search import search_layouts

    model: GLM5Config = GLM5Config.from_hf_dir(args.hf_dir) if args.hf_dir else None
    if model is None:
        if args.model not in MODELS:
            raise ValueError(f"--model: unknown preset {args.model!r}; known: {sorted(MODELS)}")
        model = MODELS[args.model]()
    job, cluster = _job_from_args(args)
    plan = plan_job(model, job, cluster)
    print(format_plan(plan))
    out = {"plan": plan.as_dict()}
    if args.search and job.rollout is not None:  # RL: colocated and separate placements
        from glm5_mcore.plan.report import format_rl_row
        from glm5_mcore.plan.search import search_rl

        found = search_rl(model, job, cluster)
        print(f"\nfeasible RL layouts on {cluster.describe()}, fewest GPUs first (colocated and separate):")
        print("\n".join(format_rl_row(x) for x in found) or "  none on this cluster")
        out["search"] = [x.as_dict() for x in found]
    elif args.search:
        found = search_layouts(model, job, cluster)
        print("\nfeasible trainer layouts, fewest GPUs first:")
        print("\n".join(format_layout_row(p) for p in found) or "  none up to 64 nodes")
        out["search"] = [dict(p.job.layout.as_dict(), fullest_gib=round(p.worst.total / (1 << 30), 2)) for p in found]
    print(json.dumps(out))
    return 0 if plan.fits else 1
