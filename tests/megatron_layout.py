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

from glm5_mcore.checkpoint import HF_META_FILES, base_sharded_state_dict
from glm5_mcore.foreign_ckpt import RUN_CONFIG, TRACKER


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
    from megatron.core import dist_checkpointing

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
    dist_checkpointing.save(state, str(path), content_metadata={"singleton_local_shards": False,
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
