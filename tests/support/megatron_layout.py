"""Checkpoint folders in Megatron-LM's and Megatron-Bridge's layout, built in the tests the way their
trainers save (``generate_state_dict`` / Bridge's ``save_checkpoint``): the distributed checkpoint
directly under ``iter_N/`` with the non-tensor state beside the model's tensors, the tracker file,
Bridge's ``run_config.yaml`` + ``tokenizer/`` + ``train_state.pt``; routers stored in bf16."""

import argparse
import dataclasses
import shutil
from pathlib import Path

import torch
import yaml

from glm5_mcore.checkpoint.layout import HF_META_FILES
from glm5_mcore.checkpoint.dist import base_sharded_state_dict, save_sharded
from glm5_mcore.checkpoint.megatron_lm import RUN_CONFIG, TRACKER


def _plain(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    return None


def megatron_fields(model) -> dict:
    """The model's TransformerConfig as Megatron field names (what Bridge's provider serializes)."""
    cfg = model.config
    out = {}
    for f in dataclasses.fields(cfg):
        v = _plain(getattr(cfg, f.name))
        if v is not None:
            out[f.name] = v
    out["vocab_size"] = model.vocab_size
    out["max_position_embeddings"] = model.max_position_embeddings
    return out


def write_megatron(root, model, iteration: int, *, flavour: str, drop_mtp: bool = False, hf_dir=None) -> Path:
    """Save ``model`` (one rank) as ``flavour`` ("megatron-lm" or "bridge") writes it under ``root``."""
    from glm5_mcore import cpu_compat

    cpu_compat.apply()
    root = Path(root)
    sd = base_sharded_state_dict(model)
    for k, v in sd.items():
        if k.endswith("mlp.router.weight"):  # Megatron keeps the router in params_dtype (bf16)
            v.data = v.data.to(torch.bfloat16)
            v.dtype = torch.bfloat16
    if drop_mtp:
        sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    fields = megatron_fields(model)
    state = {"model": sd, "checkpoint_version": 3.0, "iteration": iteration,
             "rng_state": [{"random_rng_state": 0, "np_rng_state": None}],
             "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": iteration}}
    if flavour == "megatron-lm":
        args = dict(fields)
        args["num_experts"] = args.pop("num_moe_experts")
        args["norm_epsilon"] = args.pop("layernorm_epsilon")
        args["padded_vocab_size"] = args.pop("vocab_size")
        if drop_mtp:
            args["mtp_num_layers"] = None
        state["args"] = argparse.Namespace(**args)
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    save_sharded(state, path, content_metadata={"singleton_local_shards": False,  # no Manager queue (dist.py)
                                                "distrib_optim_sharding_type": "dp_reshardable"})
    (root / TRACKER).write_text(f"{iteration}\n")
    if flavour == "bridge":
        model_cfg = {"_target_": "megatron.bridge.models.mla_provider.MLAModelProvider", **fields}
        if drop_mtp:
            model_cfg["mtp_num_layers"] = None
        (path / RUN_CONFIG).write_text(yaml.safe_dump({"model": model_cfg, "train": {"train_iters": iteration}}))
        (path / "tokenizer").mkdir()
        for name in HF_META_FILES:
            if name != "config.json" and (Path(hf_dir) / name).is_file():
                shutil.copy2(Path(hf_dir) / name, path / "tokenizer" / name)
        torch.save({"step": iteration, "consumed_train_samples": 8 * iteration}, path / "train_state.pt")
        torch.save({"step": iteration}, root / "latest_train_state.pt")
    return root


def _expert_groups(state) -> dict:
    """{(``...mlp.experts``, "linear_fc1"/"linear_fc2"): {expert: module}} of an AdapterState."""
    import re

    out: dict = {}
    for mod in state.modules():
        m = re.match(r"^(.+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])$", mod)
        if m:
            out.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = mod
    return out


def write_bridge_peft(root, state, model, iteration: int, *, alpha: float, pretrained, hf_dir,
                      experts: str = "per_expert", canonical_fc1: bool = False, extra: dict | None = None,
                      peft_target: str = "megatron.bridge.peft.lora.LoRA") -> Path:
    """``state`` (an AdapterState, our module names) saved as Megatron-Bridge's PEFT training saves it
    (one rank): the adapters only (``apply_peft_adapter_filter_to_state_dict``), bf16 as its
    ``ParallelLinearAdapter`` keeps them, ``{module}.adapter.linear_in/linear_out.weight``; fc1's B
    through Megatron-Core's ``apply_swiglu_sharded_factory`` as the adapter's ``sharded_state_dict``
    does; routed experts under ``mlp.experts.experts.linear_fc{1,2}`` (Megatron-Core's sharded key for
    TEGroupedMLP and SequentialMLP alike) with the global expert axis:
    ``experts="per_expert"`` (``GroupedExpertLinearAdapter``: one [E, r, in] tensor, SwiGLU halves
    split on axis 1), ``"shared"`` (the default shared adapter: expert 0's, one shard per expert slot
    via the expert-axis factory), ``"legacy"`` (shared, 2-D); ``canonical_fc1``: CanonicalLoRA's
    ``adapter.adapter_gate`` / ``adapter_up`` on the dense and shared-expert fc1. ``extra``: more
    tensors (key -> tensor). ``run_config.yaml``: ``model``, ``peft``, ``checkpoint``, ``tokenizer``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from glm5_mcore import cpu_compat

    cpu_compat.apply()
    root = Path(root)
    sd: dict = {}

    def st(key, t, *offsets, prepend=0):
        return ShardedTensor.from_rank_offsets(key, t.to(torch.bfloat16).contiguous(), *offsets,
                                               replica_id=(0, 0, 0), prepend_axis_num=prepend)

    grouped = _expert_groups(state)
    in_groups = {m for g in grouped.values() for m in g.values()}
    for mod in state.modules():
        if mod in in_groups:
            continue
        a, b = state.A[mod], state.B[mod]
        fc1 = mod.endswith("linear_fc1")
        if canonical_fc1 and fc1:
            i = b.shape[0] // 2
            for half, bh in (("gate", b[:i]), ("up", b[i:])):
                k = f"{mod}.adapter.adapter_{half}.linear_"
                sd[k + "in.weight"], sd[k + "out.weight"] = st(k + "in.weight", a), st(k + "out.weight", bh)
            continue
        k = f"{mod}.adapter.linear_"
        sd[k + "in.weight"] = st(k + "in.weight", a)
        sd[k + "out.weight"] = apply_swiglu_sharded_factory(st(k + "out.weight", b), ()) if fc1 else \
            st(k + "out.weight", b)
    for (prefix, fc), mods in grouped.items():
        n = len(mods)
        ka, kb = (f"{prefix}.experts.{fc}.adapter.linear_{x}.weight" for x in ("in", "out"))  # MCore's expert keys
        if experts == "per_expert":
            a = torch.stack([state.A[mods[e]] for e in range(n)])
            b = torch.stack([state.B[mods[e]] for e in range(n)])
            sd[ka] = st(ka, a)
            if fc == "linear_fc1":
                w, v = b.chunk(2, dim=1)
                sd[kb] = [st(kb, w, (1, 0, 2)), st(kb, v, (1, 1, 2))]
            else:
                sd[kb] = st(kb, b)
        elif experts == "shared":
            a, b = state.A[mods[0]], state.B[mods[0]]
            sd[ka] = [st(ka, a, (0, e, n), prepend=1) for e in range(n)]
            if fc == "linear_fc1":
                w, v = b.chunk(2, dim=0)
                sd[kb] = [x for e in range(n) for x in (st(kb, w, (0, e, n), (1, 0, 2), prepend=1),
                                                        st(kb, v, (0, e, n), (1, 1, 2), prepend=1))]
            else:
                sd[kb] = [st(kb, b, (0, e, n), prepend=1) for e in range(n)]
        else:  # legacy shared: 2-D
            sd[ka], sd[kb] = st(ka, state.A[mods[0]]), st(kb, state.B[mods[0]])
    for k, t in (extra or {}).items():
        sd[k] = st(k, t)
    state_dict = {"model": sd, "checkpoint_version": 3.0, "iteration": iteration,
                  "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": iteration}}
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    save_sharded(state_dict, path, content_metadata={"singleton_local_shards": False})
    (root / TRACKER).write_text(f"{iteration}\n")
    r = next(iter(state.A.values())).shape[0]
    run_config = {
        "model": {"_target_": "megatron.bridge.models.mla_provider.MLAModelProvider", **megatron_fields(model)},
        "peft": {"_target_": peft_target, "dim": r, "alpha": alpha, "dropout": 0.0,
                 "target_modules": ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                    "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"]},
        "checkpoint": {"save": str(root), "pretrained_checkpoint": str(pretrained) if pretrained else None},
        "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(hf_dir)},
    }
    (path / RUN_CONFIG).write_text(yaml.safe_dump(run_config))
    torch.save({"step": iteration}, path / "train_state.pt")
    return root
