"""``glm5 parity``: our Megatron-Core GLM-5 against transformers' ``GlmMoeDsaForCausalLM``.

Both run the same HF checkpoint on the same tokens in fp32 (whatever the checkpoint stores). The
JSON line reports the max / mean absolute logit difference, the fraction of indexer top-k sets and
router expert sets that agree (as sets; top-k only on rows with at least k causal keys), the
tolerance and the verdict. Under torchrun the Megatron side runs at the given TP/EP/CP (gloo on
CPU); logits and choices are gathered to rank 0, which runs the reference and prints.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from glm5_mcore.checkpoint.atomic import check_output_file
from glm5_mcore.checkpoint.layout import hf_source_dir
from glm5_mcore.checkpoint.megatron_lm import is_foreign
from glm5_mcore.config import GLM5Config
from glm5_mcore.device import training_device
from glm5_mcore.lora.peft import import_peft
from glm5_mcore.lora.state import load_adapter_state
from glm5_mcore.mcore_settings import ParallelConfig, padded_vocab_size
from glm5_mcore.model.build import build_model, forward_logits
from glm5_mcore.model.dsa import GLM5SparseAttention, keeping_topk
from glm5_mcore.model.parallel import init_parallel
from glm5_mcore.training.model_source import ModelSource, resolve_model
from glm5_mcore.training.schema import ModelCfg

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_TRANSFORMERS = (5, 13)


def check_transformers_version() -> None:
    """Warn when the installed transformers computes a different (pre-5.13) indexer."""
    try:
        import transformers
    except ImportError:
        return
    parts = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    if parts < MIN_TRANSFORMERS:
        warnings.warn(f"transformers {transformers.__version__} < 5.13 computes a different GLM-5 "
                      "indexer (half-split RoPE / no ReLU); the parity reference is wrong")


def _all_gather_cat(t: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def load_input_ids(path: Optional[str], vocab_size: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """``input_ids`` int64 [B, S] from a safetensors file, or random tokens."""
    if path is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (batch, seq), generator=g)
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: --input-ids file does not exist")
    try:
        d = load_file(path)
    except Exception as e:  # empty, truncated or not safetensors
        raise ValueError(f"{path}: --input-ids is not a readable safetensors file ({str(e)[:200]})") from None
    if "input_ids" not in d:
        raise ValueError(f"{path}: no tensor called 'input_ids' (found {sorted(d)})")
    ids = d["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"{path}: input_ids must be [B, S], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{path}: input_ids is empty, shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{path}: input_ids has dtype {ids.dtype}, expected an integer type (token ids)")
    if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
        raise ValueError(f"{path}: input_ids outside [0, vocab_size={vocab_size})")
    return ids.long()


def model_source(hf_dir: str, ckpt: Optional[str] = None) -> ModelSource:
    """The model parity builds, resolved as training resolves it (``glm5_mcore.training.model_source``): config
    and tokenizer from ``hf_dir``, weights from ``ckpt`` (ours, or a Megatron-LM / Bridge one whose config is
    checked against ``hf_dir``'s) when given, else from ``hf_dir``; MTP layers as the weights store them."""
    return resolve_model(ModelCfg(hf_dir=hf_dir, ckpt=ckpt))


def megatron_forward(source: ModelSource, input_ids: torch.Tensor, parallel: ParallelConfig, dtype: torch.dtype,
                     adapter: Optional[str] = None):
    """Run our model (``source``: ``model_source``) on this rank's tokens; return (logits [B,S,V], topk per
    layer [B,S,K] or None, router sets per MoE layer [B*S, E] bool), all gathered to natural token order."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    init_parallel(parallel)
    glm5 = source.glm5
    model = build_model(glm5, parallel)
    source.load_weights(model)
    if adapter is not None:
        load_adapter_state(model, import_peft(adapter, glm5.num_hidden_layers), "default", trainable=False)
    model = model.to(dtype).eval()
    B, S = input_ids.shape
    dev = training_device()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    pos = dsa_layout.build_zigzag_cp_local_positions(S, cp, cp_rank, dev)
    input_ids = input_ids.to(dev)
    routers = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: routers.append(out[1].detach()))
             for n, m in model.named_modules() if n.startswith("decoder.") and n.endswith("mlp.router")]
    with torch.no_grad(), keeping_topk(model):
        logits = forward_logits(model, input_ids[:, pos], pos[None].expand(B, -1).contiguous())
        for h in hooks:
            h.remove()
        logits, topks, router_sets = _gather_to_token_order(model, logits, routers, pos, B, S)
    return logits.cpu(), [None if t is None else t.cpu() for t in topks], [r.cpu() for r in router_sets]


def _gather_to_token_order(model, logits, routers, pos, B: int, S: int):
    """Logits, indexer top-k and router sets of every rank gathered (on the training device) into
    natural token order."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    tp_group = ps.get_tensor_model_parallel_group()
    order = torch.argsort(_all_gather_cat(pos, cp_group))
    logits = _all_gather_cat(logits.float(), cp_group, dim=1)[:, order]
    topks = []
    for m in model.decoder.modules():
        if isinstance(m, GLM5SparseAttention):
            t = m.last_topk
            topks.append(None if t is None else _all_gather_cat(t, cp_group, dim=1)[:, order])
    router_sets = []
    for r in routers:  # [S_local/TP * B, E], rows s-major
        r = _all_gather_cat(r.int(), tp_group if model.config.sequence_parallel else None)
        r = r.view(-1, B, r.shape[-1])
        r = _all_gather_cat(r, cp_group, dim=0)[order]
        router_sets.append(r.transpose(0, 1).reshape(B * S, -1).bool())
    return logits, topks, router_sets


def reference_forward(hf_dir: str, input_ids: torch.Tensor, dtype: torch.dtype, adapter: Optional[str] = None):
    """transformers' logits, indexer top-k per full layer and router sets per MoE layer (with the
    PEFT ``adapter`` loaded by ``peft`` when given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    topks, routers = [], []
    for layer in model.get_base_model().model.layers if adapter is not None else model.model.layers:
        attn = layer.self_attn
        if getattr(attn, "indexer", None) is not None:
            attn.indexer.register_forward_hook(lambda mod, inp, out: topks.append(out.long()))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(lambda mod, inp, out: routers.append(out[2]))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    sets = []
    for idx in routers:
        m = torch.zeros(idx.shape[0], model.config.n_routed_experts, dtype=torch.bool)
        sets.append(m.scatter_(1, idx, True))
    return logits, topks, sets


def topk_agreement(ours: list, ref: list, indexer_types: list[str], S: int) -> float:
    """Fraction of (layer, batch, row) top-k sets equal, over rows t >= k-1 of full layers."""
    agree = total = 0
    ours_full = [t for t, kind in zip(ours, indexer_types) if kind == "full"]
    for a, b in zip(ours_full, ref):
        K = b.shape[-1]
        if a is None:  # our side skipped the indexer: K >= T, every causal key selected
            continue
        for t in range(K - 1, S):
            for bi in range(b.shape[0]):
                agree += int(set(a[bi, t].tolist()) == set(b[bi, t].tolist()))
                total += 1
    return agree / total if total else 1.0


def run_parity(hf_dir: str, input_ids: torch.Tensor, parallel: ParallelConfig, dtype: str = "fp32",
               atol: float = 1e-4, save_logits: Optional[str] = None,
               ckpt: Optional[str] = None, adapter: Optional[str] = None) -> Optional[dict]:
    """Compare and return the report dict (rank 0) or None (other ranks). With ``ckpt`` our model
    loads that Megatron checkpoint and the reference runs the HF weights in ``hf_dir``."""
    source = model_source(hf_dir, ckpt)
    glm5 = source.glm5
    check_transformers_version()
    td = DTYPES[dtype]
    logits, topks, routers = megatron_forward(source, input_ids, parallel, td, adapter)
    if dist.get_rank() != 0:
        return None
    if save_logits:
        from safetensors.torch import save_file

        tmp = f"{save_logits}.tmp"
        save_file({"logits": logits.contiguous()}, tmp, metadata={"glm5-output": SAVE_LOGITS_KIND})
        os.replace(tmp, save_logits)
    ref_logits, ref_topks, ref_routers = reference_forward(hf_dir, input_ids, td, adapter)
    diff = (logits - ref_logits).abs()
    r_agree = (sum(int((a == b).all(-1).sum()) for a, b in zip(routers, ref_routers))
               / max(1, sum(a.shape[0] for a in routers)))
    report = {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "topk_agree": topk_agreement(topks, ref_topks, glm5.indexer_types, input_ids.shape[1]),
        "router_agree": r_agree,
        "atol": atol,
        "pass": None if dtype != "fp32" else bool(diff.max() <= atol),
        "dtype": dtype,
        "tp": parallel.tp, "ep": parallel.ep, "cp": parallel.cp, "adapter": adapter,
        "vocab_rows": padded_vocab_size(glm5.vocab_size, parallel.tp, parallel.make_vocab_size_divisible_by),
        "shape": list(logits.shape),
    }
    return report


SAVE_LOGITS_KIND = "parity --save-logits"


def _logits_file_kind(path) -> Optional[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("glm5-output")


def main(args) -> int:
    """Entry for ``glm5 parity`` (argparse namespace from ``recipes.main``)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hf_dir, ckpt = args.hf_dir, getattr(args, "ckpt", None)
    if ckpt is not None and hf_dir is None:
        if is_foreign(ckpt):
            raise ValueError(f"{ckpt}: a Megatron-LM / Megatron-Bridge checkpoint; pass --hf-dir with the "
                             "HF weights to compare with")

        hf_dir = hf_source_dir(ckpt)
        if hf_dir is None:
            raise FileNotFoundError(f"{ckpt}/hf/source.json: missing; pass --hf-dir with the HF weights")
        hf_dir = str(hf_dir)
    if hf_dir is None:
        raise ValueError("give --hf-dir (and/or --ckpt)")
    if args.save_logits:
        check_output_file(args.save_logits, SAVE_LOGITS_KIND, _logits_file_kind, [args.input_ids],
                          getattr(args, "overwrite", False), what="--save-logits")
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    parallel = ParallelConfig(tp=args.tp, ep=args.ep, cp=args.cp,
                              make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 1))
    try:
        parallel.validate(glm5)  # from the config, before any rank builds
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    ids = load_input_ids(args.input_ids, glm5.vocab_size, args.batch, args.seq_len, args.seed)
    report = run_parity(hf_dir, ids, parallel, args.dtype, args.atol, args.save_logits, ckpt,
                        getattr(args, "adapter", None))
    code = 0
    if report is not None:
        print(json.dumps(report), flush=True)
        code = 1 if report["pass"] is False else 0
    if dist.is_initialized():
        codes = torch.tensor([code], device=training_device())
        dist.broadcast(codes, 0)
        code = int(codes)
        dist.destroy_process_group()
    return code
