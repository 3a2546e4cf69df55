"""``glm5 checkpoint export --format megatron``: our checkpoint in the layout Megatron-LM and
Megatron-Bridge load (``glm5_mcore.checkpoint.megatron_lm`` describes it and reads it back).

Megatron's loaders read ``iter_N/`` itself as the distributed checkpoint (Bridge's export takes the
newest ``iter_*``), ours keeps it under ``iter_N/model/`` beside adapters and optimizer state, so the
export writes a separate folder: the checkpoint files hard-linked (copied across file systems), the
tracker file, Bridge's ``run_config.yaml`` (``model``: its GLM-5 provider; ``tokenizer``) and
``tokenizer/``, and a per-iteration checksum manifest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint.megatron_lm import RUN_CONFIG, TOKENIZER_DIR, TRACKER, is_foreign, say_once, stored_keys
from glm5_mcore.checkpoint import manifest
from glm5_mcore.checkpoint.fp8_sharded import SCALE_SUFFIX
from glm5_mcore.checkpoint.atomic import check_output, output_dir, scratch_dir
from glm5_mcore.checkpoint.layout import (adapter_dir, HF_META_FILES, iter_dir, latest_iteration, model_dir,
                                          require_iteration)
from glm5_mcore.config import GLM5Config
from glm5_mcore.convert.common import checkpoint_dtype
from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
from glm5_mcore.convert.merge_base import base_checkpoint
from glm5_mcore.lora.state import read_adapter_state


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

    root = Path(ckpt)
    if is_foreign(root):
        raise ValueError(f"{root}: already a Megatron-LM / Megatron-Bridge checkpoint")
    check_output(out, "checkpoint export", [root], overwrite)
    it = latest_iteration(root) if iteration is None else iteration
    state = read_adapter_state(adapter_dir(root, merge_adapter, it))
    work = scratch_dir(Path(out).absolute().parent, ".glm5-export-")  # a killed run's is removed by the next
    try:
        base, base_it = base_checkpoint(root, it, work)
        hf = mcore_to_hf(base, work / "hf", iteration=base_it, progress=False, merge_adapter=state,
                         kind="lora export")
        merged = hf_to_mcore(hf, work / "mc", progress=False, dequantize_fp8=True)  # what Megatron-LM loads
        (merged / "hf" / "source.json").unlink(missing_ok=True)  # the scratch folder goes away
        return _export_megatron(merged, out, None, overwrite, inputs=[root], name_iteration=it)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def refuse_fp8_base(keys: set[str], src: Path) -> None:
    """A checkpoint storing its base in FP8 (``checkpoint.fp8_sharded``) is refused in one line: Megatron-LM and
    Megatron-Bridge would load its e4m3 bytes as plain weights, without their block scales."""
    if any(k.endswith(SCALE_SUFFIX) for k in keys):
        raise ValueError(f"{src}: stores the frozen base in FP8 (e4m3 + {SCALE_SUFFIX} block scales, as hf-to-mcore "
                         "keeps an FP8 release), which Megatron-LM / Megatron-Bridge would load as plain weights; "
                         "convert the HF folder with glm5 convert hf-to-mcore --dequantize-fp8 and export that")


def _export_megatron(ckpt: str | Path, out: str | Path, iteration: Optional[int] = None,
                     overwrite: bool = False, inputs=None, name_iteration: Optional[int] = None) -> Path:
    """``glm5 checkpoint export --format megatron``: our checkpoint's base weights in the layout
    Megatron-LM and Megatron-Bridge load (``OUT/iter_N/`` = the distributed checkpoint, its files
    hard-linked where the file system allows, else copied; ``latest_checkpointed_iteration.txt``;
    ``iter_N/run_config.yaml`` with the model provider and an HF tokenizer config; ``iter_N/tokenizer/``)."""
    import yaml

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
    refuse_fp8_base(have, src)
    if glm5.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in have):
        glm5 = GLM5Config.from_hf_dict({**glm5.to_hf_dict(), "num_nextn_predict_layers": 0})
    if inputs is None and (iter_dir(root, it) / "adapters").is_dir():
        say_once(f"{iter_dir(root, it) / 'adapters'}: adapters not merged (base weights exported); "
                 "--merge-adapter NAME exports the base with that adapter merged in")
    manifest.verify_under(src)  # what is linked out is what was saved
    dtype = checkpoint_dtype(src)
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
                    manifest.remember_file_digest(dst / p.name, entry["digest"])
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
