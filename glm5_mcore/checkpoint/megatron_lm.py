"""Reading checkpoint folders written by Megatron-LM and Megatron-Bridge (writing ours in their layout:
``glm5_mcore.convert.megatron_export``).

Their layout (Megatron-LM ``megatron/training/checkpointing.py``: ``get_checkpoint_name``,
``read_metadata``; Megatron-Bridge ``training/checkpointing.py``, ``AutoBridge.load_megatron_model``)::

    DIR/
      latest_checkpointed_iteration.txt   "N" or "release" (Bridge also writes latest_train_state.pt)
      iter_{N:07d}/  (or release/)        the torch_dist checkpoint itself: metadata.json, .metadata,
                                          __*.distcp; the common state (args, checkpoint_version,
                                          iteration, content_metadata, rng, optimizer groups) in common.pt
                                          or, newer Megatron-Core, the "common_state" object inside
        run_config.yaml                   Bridge: the ConfigContainer; ``model`` is the model provider
        tokenizer/                        Bridge: the HF tokenizer files
        train_state.pt                    Bridge

Ours keeps the distributed checkpoint under ``iter_N/model/`` beside ``adapters/`` and ``optimizer/``
with ``latest``; Megatron's loaders read ``iter_N/`` itself as the checkpoint (Bridge's export takes
the newest ``iter_*``, ignoring the tracker), so both cannot share one folder: ``megatron_export``
writes theirs. Foreign checkpoints carry no checksum manifest: they load unverified (said once).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from glm5_mcore.checkpoint.manifest import NAME
from glm5_mcore.config import GLM5Config, MODEL_TYPE
from glm5_mcore.mcore_settings import padded_vocab_size

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
TOKENIZER_DIR = "tokenizer"

# Megatron (TransformerConfig / Bridge provider) field -> GLM5Config (HF) field, one-to-one
_DIRECT = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "num_moe_experts": "n_routed_experts", "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_router_topk": "num_experts_per_tok", "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "rotary_base": "rope_theta", "layernorm_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
    "dsa_indexer_n_heads": "index_n_heads", "dsa_indexer_head_dim": "index_head_dim",
    "dsa_indexer_topk": "index_topk", "max_position_embeddings": "max_position_embeddings",
}
# Megatron-LM argparse names that differ from TransformerConfig's
_MLM_ALIASES = {"num_experts": "num_moe_experts", "norm_epsilon": "layernorm_epsilon",
                "padded_vocab_size": "vocab_size"}
# GLM5Config fields that fix the tensors' shapes and the model's function (checked against an HF config)
ARCH_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
               "moe_intermediate_size", "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor",
               "rope_theta", "rms_norm_eps", "vocab_size", "index_n_heads", "index_head_dim", "index_topk",
               "mlp_layer_types", "n_group", "topk_group")

_said: set = set()


def say_once(msg: str) -> None:
    """Print ``msg`` to stderr once per process (rank 0 only)."""
    if msg in _said or int(os.environ.get("RANK", "0")) != 0:
        return
    _said.add(msg)
    print(f"glm5: {msg}", file=sys.stderr, flush=True)


def is_foreign(root: str | Path) -> bool:
    """True for a Megatron-LM / Megatron-Bridge folder (tracker file, ``iter_N/`` or ``release/``
    holding a distributed checkpoint, or such an iteration folder itself); False for ours (``latest``)."""
    root = Path(root)
    if (root / "latest").is_file():
        return False
    if (root / TRACKER).is_file() or (root / "metadata.json").is_file():
        return True
    return any((p / "metadata.json").is_file() for p in [*root.glob("iter_*"), root / "release"])


def _iterations(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit()
                  and (p / "metadata.json").is_file())


def model_path(root: str | Path, iteration: Optional[int] = None) -> Path:
    """The distributed-checkpoint folder of a Megatron-LM / Bridge checkpoint: ``iteration``'s, else the
    one the tracker file names, else the newest ``iter_*`` (Bridge's rule); errors name the file."""
    root = Path(root)
    if (root / "metadata.json").is_file():  # an iteration folder given directly
        if iteration is not None:
            raise ValueError(f"{root}: an iteration folder itself; --iteration {iteration} does not apply")
        return root
    if iteration is not None:
        path = root / f"iter_{iteration:07d}"
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: iteration {iteration} does not exist in {root} "
                                    f"(it has {_iterations(root) or 'no iterations'})")
    elif (root / TRACKER).is_file():
        text = (root / TRACKER).read_text().strip()
        if text == "release":
            path = root / "release"
        elif text.isdigit():
            path = root / f"iter_{int(text):07d}"
        else:
            raise ValueError(f"{root / TRACKER}: expected an iteration number or 'release', found {text[:40]!r}")
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: named by {root / TRACKER} but missing")
    else:
        its = _iterations(root)
        if not its:
            raise FileNotFoundError(f"{root}: no iter_* folder holding a distributed checkpoint")
        path = root / f"iter_{its[-1]:07d}"
    if not (path / "metadata.json").is_file():
        legacy = "; Megatron-LM's legacy torch format (mp_rank_*/model_optim_rng.pt) is not read" if any(
            path.glob("mp_rank_*")) else ""
        raise FileNotFoundError(f"{path}: not a Megatron-Core distributed checkpoint (no metadata.json){legacy}")
    return path


def checkpoint_kind(path: Path) -> str:
    return "Megatron-Bridge" if run_config_file(path) is not None else "Megatron-LM"


def run_config_file(path: Path) -> Optional[Path]:
    """Megatron-Bridge's ``run_config.yaml`` of a checkpoint (in ``iter_N`` or its root), or None (Megatron-LM)."""
    for p in (path / RUN_CONFIG, path.parent / RUN_CONFIG):
        if p.is_file():
            return p
    return None


def own_megatron_config(path: Path) -> tuple[Optional[dict], str]:
    """The checkpoint's own model config as Megatron field names: Bridge's ``run_config.yaml`` ``model``
    section, else Megatron-LM's ``args`` in ``common.pt``. (None, why) when it has none readable."""
    rc = run_config_file(path)
    if rc is not None:
        import yaml

        try:
            model = (yaml.safe_load(rc.read_text()) or {}).get("model")
        except yaml.YAMLError as e:
            raise ValueError(f"{rc}: not valid YAML ({' '.join(str(e).split())[:200]})") from None
        if not isinstance(model, dict):
            raise ValueError(f"{rc}: no 'model' section")
        return model, str(rc)
    from megatron.core import dist_checkpointing

    try:  # common.pt (older Megatron-Core) or the "common_state" object inside the checkpoint
        state = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # args pickled with classes this environment lacks
        return None, f"{path}: no {RUN_CONFIG}, and its common state is unreadable ({type(e).__name__}: {str(e)[:120]})"
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        return None, f"{path}: no {RUN_CONFIG} and no Megatron-LM args in its common state"
    d = dict(vars(args))
    for old, new in _MLM_ALIASES.items():
        if old in d and d.get(new) is None:
            d[new] = d[old]
    return d, f"{path} (Megatron-LM args)"


def hf_dict_from_megatron(m: dict) -> dict:
    """An HF ``glm_moe_dsa`` config dict from Megatron config fields (GLM5Config.to_mcore_config inverted)."""
    d: dict[str, Any] = {"model_type": MODEL_TYPE}
    for mk, hk in _DIRECT.items():
        if m.get(mk) is not None:
            d[hk] = m[mk]
    if m.get("num_attention_heads") is not None:
        d["num_key_value_heads"] = m["num_attention_heads"]
    if m.get("moe_shared_expert_intermediate_size") and m.get("moe_ffn_hidden_size"):
        d["n_shared_experts"] = m["moe_shared_expert_intermediate_size"] // m["moe_ffn_hidden_size"]
    elif "moe_shared_expert_intermediate_size" in m:
        d["n_shared_experts"] = 0
    freq, n = m.get("moe_layer_freq"), m.get("num_layers")
    if isinstance(freq, (list, tuple)):
        d["mlp_layer_types"] = ["sparse" if int(x) else "dense" for x in freq]
    elif isinstance(freq, int) and n:
        d["mlp_layer_types"] = ["sparse" if i % freq == 0 else "dense" for i in range(n)]
    if d.get("mlp_layer_types"):
        t = d["mlp_layer_types"]
        d["first_k_dense_replace"] = next((i for i, x in enumerate(t) if x == "sparse"), len(t))
    d["n_group"] = m.get("moe_router_num_groups") or 1
    d["topk_group"] = m.get("moe_router_group_topk") or 1
    d["num_nextn_predict_layers"] = m.get("mtp_num_layers") or 0
    if m.get("dsa_indexer_topk_freq") is not None:
        d["index_topk_freq"] = m["dsa_indexer_topk_freq"]
    if m.get("dsa_indexer_skip_topk_offset") is not None:
        d["index_skip_topk_offset"] = m["dsa_indexer_skip_topk_offset"]
    return d


def dcp_metadata(path: str | Path) -> dict:
    """PyTorch-DCP's per-key metadata (shape, dtype, chunks) of the distributed checkpoint at ``path``, read
    from its ``.metadata`` only; unreadable: a ValueError naming it."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a bad input
        raise ValueError(f"{path}: unreadable distributed-checkpoint metadata ({type(e).__name__}: {e})") from None


def stored_keys(path: Path) -> set[str]:
    return set(dcp_metadata(path))


def check_same_arch(cfg, other, where: str, other_name: str = "the HF config") -> None:
    """Every ``ARCH_FIELDS`` field of two GLM5Configs agrees; else an error naming ``where`` and the field."""
    for f in ARCH_FIELDS:
        a, b = getattr(cfg, f), getattr(other, f)
        if a != b and not (isinstance(a, float) and isinstance(b, (int, float)) and abs(a - b) <= 1e-9 * abs(b)):
            raise ValueError(f"{where}: {f} = {a!r} but {other_name} says {b!r}")


def _unpadded_vocab(own: dict, vocab: int, where: str) -> dict:
    """``own`` with the HF config's ``vocab`` when Megatron-LM's args record only the padded vocabulary
    (``padded_vocab_size``, no ``vocab_size``: its tokenizer's size padded to a multiple of
    ``make_vocab_size_divisible_by`` × TP, default 128) and that is ``vocab`` padded: the padded rows are
    dropped on load (``glm5_mcore.model.vocab``)."""
    padded = own.get("padded_vocab_size")
    if padded is None or own.get("vocab_size") != padded or padded == vocab:
        return own
    rows = padded_vocab_size(vocab, own.get("tensor_model_parallel_size") or 1,
                             own.get("make_vocab_size_divisible_by") or 128)
    if rows != padded:
        return own  # not this vocabulary's padding: check_same_arch names the difference
    say_once(f"{where}: padded_vocab_size={padded} is Megatron-LM's padding of the HF config's vocab_size={vocab}; "
             "the padded rows are left out")
    return {**own, "vocab_size": vocab}


def glm5_config(root: str | Path, hf=None, iteration: Optional[int] = None):
    """The GLM5Config to build for a Megatron-LM / Bridge checkpoint: its own config (``run_config.yaml`` /
    ``common.pt`` args) checked field by field against ``hf`` (a GLM5Config from an HF config.json)
    when given, else ``hf`` alone when the checkpoint has no readable config; MTP only when the
    checkpoint holds MTP tensors (Bridge drops them by default)."""
    import dataclasses

    path = model_path(root, iteration)
    own, where = own_megatron_config(path)
    if own is not None and hf is not None:
        own = _unpadded_vocab(own, hf.vocab_size, where)
    cfg = None
    if own is not None:
        try:
            cfg = GLM5Config.from_hf_dict(hf_dict_from_megatron(own), source=where)
        except ValueError as e:
            if hf is None:
                raise
            say_once(f"{where}: not read as a GLM-5 config ({e}); the HF config alone is used")
    if cfg is not None and hf is not None:
        check_same_arch(cfg, hf, where)
        cfg = hf
    elif cfg is None:
        if hf is not None and own is None:
            say_once(f"{where}: no config of its own; the HF config alone is used")
        if hf is None:
            raise ValueError(f"{where}; give the HF config (--hf-dir / model.hf_dir) of this model")
        cfg = hf
    keys = stored_keys(path)
    if any(".adapter." in k for k in keys) and not any(
            k.startswith(("embedding.", "decoder.", "output_layer.", "mtp.")) and ".adapter." not in k for k in keys):
        raise ValueError(f"{path}: holds LoRA adapter tensors only (a Megatron-Bridge PEFT checkpoint), no base "
                         "weights: `glm5 lora export` reads it (with --merged, onto its base: run_config.yaml "
                         "checkpoint.pretrained_checkpoint)")
    has_mtp = any(k.startswith("mtp.") for k in keys)
    if cfg.num_nextn_predict_layers and not has_mtp:
        say_once(f"{path}: no MTP tensors in this checkpoint; the model is built without the MTP layer")
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    if not any((p / NAME).is_file() for p in (path, path.parent)):
        say_once(f"{path}: a {checkpoint_kind(path)} checkpoint: no checksum manifest, loaded unverified")
    return cfg


def hf_meta_source(root: str | Path, iteration: Optional[int] = None) -> Optional[Path]:
    """Where the tokenizer files of a foreign checkpoint are: Bridge's ``iter_N/tokenizer/``."""
    path = model_path(root, iteration)
    for p in (path / TOKENIZER_DIR, path.parent / TOKENIZER_DIR):
        if p.is_dir():
            return p
    return None


def hf_side(root: str | Path, iteration: Optional[int] = None):
    """(GLM5Config, HF config.json dict, tokenizer folder or None) for writing a foreign checkpoint as an
    HF folder: the architecture from the checkpoint's own config, the tokenizer Bridge saved."""
    cfg = glm5_config(root, None, iteration)
    return cfg, cfg.to_hf_dict(), hf_meta_source(root, iteration)

