"""Checkpoint folders written by Megatron-LM and Megatron-Bridge (read), and our checkpoints in their
layout (``glm5 checkpoint export --format megatron``).

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
the newest ``iter_*``, ignoring the tracker), so both cannot share one folder: ``export_megatron``
writes theirs. Foreign checkpoints carry no checksum manifest: they load unverified (said once).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

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
    return "Megatron-Bridge" if _run_config_file(path) is not None else "Megatron-LM"


def _run_config_file(path: Path) -> Optional[Path]:
    for p in (path / RUN_CONFIG, path.parent / RUN_CONFIG):
        if p.is_file():
            return p
    return None


def own_megatron_config(path: Path) -> tuple[Optional[dict], str]:
    """The checkpoint's own model config as Megatron field names: Bridge's ``run_config.yaml`` ``model``
    section, else Megatron-LM's ``args`` in ``common.pt``. (None, why) when it has none readable."""
    rc = _run_config_file(path)
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
    from glm5_mcore.config import MODEL_TYPE

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


def stored_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as e:
        raise ValueError(f"{path}: unreadable distributed-checkpoint metadata ({type(e).__name__}: {e})") from None


def glm5_config(root: str | Path, hf=None, iteration: Optional[int] = None):
    """The GLM5Config to build for a Megatron-LM / Bridge checkpoint: its own config (``run_config.yaml`` /
    ``common.pt`` args) checked field by field against ``hf`` (a GLM5Config from an HF config.json)
    when given, else ``hf`` alone when the checkpoint has no readable config; MTP only when the
    checkpoint holds MTP tensors (Bridge drops them by default)."""
    import dataclasses

    from glm5_mcore.config import GLM5Config

    path = model_path(root, iteration)
    own, where = own_megatron_config(path)
    cfg = None
    if own is not None:
        try:
            cfg = GLM5Config.from_hf_dict(hf_dict_from_megatron(own), source=where)
        except ValueError:
            if hf is None:
                raise
    if cfg is not None and hf is not None:
        for f in ARCH_FIELDS:
            a, b = getattr(cfg, f), getattr(hf, f)
            if a != b and not (isinstance(a, float) and isinstance(b, (int, float)) and abs(a - b) <= 1e-9 * abs(b)):
                raise ValueError(f"{where}: {f} = {a!r} but the HF config says {b!r}")
        cfg = hf
    elif cfg is None:
        if hf is None:
            raise ValueError(f"{where}; give the HF config (--hf-dir / model.hf_dir) of this model")
        cfg = hf
    has_mtp = any(k.startswith("mtp.") for k in stored_keys(path))
    if cfg.num_nextn_predict_layers and not has_mtp:
        say_once(f"{path}: no MTP tensors in this checkpoint; the model is built without the MTP layer")
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    from glm5_mcore.manifest import NAME

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


def _yaml_value(v):
    """A config value as Megatron's ``safe_yaml_representers`` writes it (functions and dtypes as
    ``{_target_, _call_: false}``); None for what a run_config cannot carry."""
    import enum
    import inspect

    import torch

    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        items = [_yaml_value(x) for x in v]
        return None if any(x is None for x in items) and any(x is not None for x in v) else items
    if isinstance(v, torch.dtype):
        return {"_target_": str(v), "_call_": False}
    if isinstance(v, enum.Enum):
        return None
    if inspect.isfunction(v) and inspect.getmodule(v) is not None and not v.__module__.startswith("glm5_mcore"):
        return {"_target_": f"{inspect.getmodule(v).__name__}.{v.__qualname__}", "_call_": False}
    return None


def bridge_model_config(glm5, dtype) -> dict:
    """Megatron-Bridge's ``run_config.yaml`` ``model`` section for ``glm5``: its GLM-5 provider
    (``MLAModelProvider``, as ``GLM5Bridge.provider_bridge`` configures it) with our TransformerConfig's
    fields, at TP/EP/PP 1 (Bridge's loader resets the layout anyway)."""
    import dataclasses

    import torch

    cfg = glm5.to_mcore_config(experimental_attention_variant_loss_scale_func=None)
    d = {"_target_": "megatron.bridge.models.mla_provider.MLAModelProvider"}
    for f in dataclasses.fields(cfg):
        v = _yaml_value(getattr(cfg, f.name))
        if v is not None and f.init and not f.name.startswith("_"):
            d[f.name] = v
    low = dtype in (torch.bfloat16, torch.float16)
    d.update(
        params_dtype=_yaml_value(dtype), bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=_yaml_value(dtype) if low else None,
        vocab_size=glm5.vocab_size, should_pad_vocab=False, make_vocab_size_divisible_by=1,
        seq_length=glm5.max_position_embeddings, position_embedding_type="rope",
        share_embeddings_and_output_weights=glm5.tie_word_embeddings,
        experimental_attention_variant="dsa", dsa_indexer_topk_freq=glm5.index_topk_freq,
        dsa_indexer_skip_topk_offset=glm5.index_skip_topk_offset,
        mtp_num_layers=glm5.num_nextn_predict_layers or None,
        transformer_layer_spec={"_target_": "megatron.core.models.gpt.experimental_attention_variant_module_specs."
                                            "get_transformer_block_with_experimental_attention_variant_spec",
                                "_call_": False})
    return d


def _link_or_copy(src: Path, dst: Path) -> str:
    try:
        os.link(src, dst)
        return "linked"
    except OSError:
        shutil.copy2(src, dst)
        return "copied"


def export_megatron(ckpt: str | Path, out: str | Path, iteration: Optional[int] = None,
                    overwrite: bool = False, merge_adapter: Optional[str] = None) -> Path:
    """``glm5 checkpoint export --format megatron``; ``merge_adapter`` (a LoRA run's adapter name):
    the weights exported are the base with that adapter merged in, made by the two streaming
    conversions (``mcore_to_hf`` merging it, ``hf_to_mcore``) in a scratch folder beside ``out``."""
    if merge_adapter is None:
        return _export_megatron(ckpt, out, iteration, overwrite)
    import tempfile

    from glm5_mcore.adapters import read_adapter_state
    from glm5_mcore.atomic import check_output
    from glm5_mcore.checkpoint import adapter_dir, hf_source_dir, latest_iteration, model_dir
    from glm5_mcore.convert import hf_to_mcore, mcore_to_hf

    root = Path(ckpt)
    if is_foreign(root):
        raise ValueError(f"{root}: already a Megatron-LM / Megatron-Bridge checkpoint")
    check_output(out, "checkpoint export", [root], overwrite)
    it = latest_iteration(root) if iteration is None else iteration
    state = read_adapter_state(adapter_dir(root, merge_adapter, it))
    Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".glm5-export-", dir=Path(out).absolute().parent))
    try:
        base, base_it = root, it
        try:
            model_dir(root, it)
        except FileNotFoundError:  # a LoRA run from an HF folder saves no base weights: its HF origin
            origin = hf_source_dir(root)
            if origin is None or not origin.is_dir():
                raise FileNotFoundError(f"{root}: no base weights saved, and its HF origin ({origin}) is "
                                        "missing") from None
            base, base_it = hf_to_mcore(origin, work / "base", progress=False), None
        hf = mcore_to_hf(base, work / "hf", iteration=base_it, progress=False, merge_adapter=state,
                         kind="lora export")
        merged = hf_to_mcore(hf, work / "mc", progress=False)
        (merged / "hf" / "source.json").unlink(missing_ok=True)  # the scratch folder goes away
        return _export_megatron(merged, out, None, overwrite, inputs=[root], name_iteration=it)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _export_megatron(ckpt: str | Path, out: str | Path, iteration: Optional[int] = None,
                     overwrite: bool = False, inputs=None, name_iteration: Optional[int] = None) -> Path:
    """``glm5 checkpoint export --format megatron``: our checkpoint's base weights in the layout
    Megatron-LM and Megatron-Bridge load (``OUT/iter_N/`` = the distributed checkpoint, its files
    hard-linked where the file system allows, else copied; ``latest_checkpointed_iteration.txt``;
    ``iter_N/run_config.yaml`` with the model provider and an HF tokenizer config; ``iter_N/tokenizer/``)."""
    import yaml

    from glm5_mcore import manifest
    from glm5_mcore.atomic import output_dir
    from glm5_mcore.checkpoint import HF_META_FILES, iter_dir, latest_iteration, model_dir, require_iteration
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.convert import _checkpoint_dtype

    root = Path(ckpt)
    if is_foreign(root):
        raise ValueError(f"{root}: already a Megatron-LM / Megatron-Bridge checkpoint")
    it = latest_iteration(root) if iteration is None else iteration
    require_iteration(root, it)
    src = model_dir(root, it)
    if not (root / "hf" / "config.json").is_file():
        raise FileNotFoundError(f"{root / 'hf' / 'config.json'}: missing; the checkpoint has no HF config")
    glm5 = GLM5Config.from_hf_dir(root / "hf")
    have = set(stored_keys(src))
    if glm5.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in have):
        glm5 = GLM5Config.from_hf_dict({**glm5.to_hf_dict(), "num_nextn_predict_layers": 0})
    if inputs is None and (iter_dir(root, it) / "adapters").is_dir():
        say_once(f"{iter_dir(root, it) / 'adapters'}: adapters not merged (base weights exported); "
                 "--merge-adapter NAME exports the base with that adapter merged in")
    manifest.verify_under(src)  # what is linked out is what was saved
    dtype = _checkpoint_dtype(src)
    it = it if name_iteration is None else name_iteration
    with output_dir(out, "checkpoint export", inputs or [root], overwrite, manifest=False) as tmp:
        dst = tmp / f"iter_{it:07d}"
        dst.mkdir()
        recorded = (manifest.read_manifest(src.parent) or {}).get("files", {})
        how = set()
        for p in sorted(src.iterdir()):
            if p.is_file():
                how.add(_link_or_copy(p, dst / p.name))
                entry = recorded.get(f"{src.name}/{p.name}")
                if entry and (dst / p.name).stat().st_ino == p.stat().st_ino:  # a link: digest known
                    manifest._KNOWN[manifest._key((dst / p.name).stat())] = entry["digest"]
        tok = dst / TOKENIZER_DIR
        tok.mkdir()
        for name in HF_META_FILES:
            if name != "config.json" and (root / "hf" / name).is_file():
                shutil.copy2(root / "hf" / name, tok / name)
        run_config = {
            "model": bridge_model_config(glm5, dtype),
            "tokenizer": {"_target_": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
                          "tokenizer_type": "HuggingFaceTokenizer",
                          "tokenizer_model": str(Path(out).absolute() / dst.name / TOKENIZER_DIR)},
        }
        (dst / RUN_CONFIG).write_text(yaml.safe_dump(run_config, sort_keys=False))
        manifest.write_manifest(dst)  # per iteration, as ours: `glm5 checkpoint verify OUT` checks it
        (tmp / TRACKER).write_text(f"{it}\n")
    say_once(f"{out}: iteration {it} ({'/'.join(sorted(how))} from {src if inputs is None else 'the merge'})")
    return Path(out)
