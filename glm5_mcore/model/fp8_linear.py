"""A frozen FP8 base (``model.base_dtype=fp8``): the base linears hold the checkpoint's e4m3 weights and
block scales as stored, and compute with exactly those values.

The storage is the release's (``glm5_mcore.checkpoint.fp8``, DeepSeek-V3 style): a weight ``W [M, N]`` is
``data [M, N]`` float8_e4m3fn and ``scale_inv [ceil(M/b), ceil(N/b)]`` fp32, one scale per b×b block
(b = the folder's ``quantization_config.weight_block_size``, ``hf_io.weight_block_size``; 128 in the release), ``W = data · scale_inv``
blockwise. Which linears: those the release stores in FP8 (``checkpoint.fp8.is_quantized`` of their HF
names: attention q/kv/o, indexer wq_b/wk, dense / shared / routed expert MLPs, decoder and MTP layers);
embeddings, output layer, norms, router, the indexer's ``weights_proj`` and the MTP ``eh_proj`` keep the
trainer's dtype, as vLLM serves them.

Two backends hold it:

- **local spec (CPU, and CUDA without Transformer Engine)**: ``BlockFP8Weight``, a tensor subclass (as
  torchao's ``NF4Tensor`` / TE's ``Float8BlockwiseQTensor``) that reports the trainer's dtype and the
  logical shape, so Megatron-Core's linears, LoRA and the checkpoint tables see an ordinary frozen weight.
  Its GEMMs (``mm`` / ``addmm``, what ``F.linear`` and Megatron's ``linear_with_frozen_weight`` reach)
  are the reference: dequantize block by block in fp32 (``checkpoint.hf_io.dequantize_fp8_blocks``) and
  multiply in the input's dtype, so in fp32 they equal a model whose base was dequantized to fp32 on
  load. Any other read (the absorbed-MLA einsum on ``kv_up.weight``) sees the dequantized weight;
  writes (merging an adapter into it) are refused. 1 byte per element + 4 per block is all it keeps.
- **Transformer Engine (``trainer.backend=te``)**: Megatron-Core's ``fp8="e4m3"``, ``fp8_recipe="blockwise"``,
  ``fp8_param=True`` (TE's ``Float8BlockScaling``: weights in 128×128 blocks, each GEMM input quantized
  on the fly in 1×128 groups, as vLLM's block-FP8 linears do; activations and adapters stay bf16 in
  memory). The weights are TE ``Float8BlockwiseQTensor`` s; ``load_block_fp8_`` writes the stored bytes
  and scales into their row-wise data (the column-wise copy TE's dgrad needs on Hopper is the exact
  transpose, made by TE only inside a module's backward and freed after it: ``model.fp8_te``, so the base
  holds 1 byte per element, not 2). TE takes a partial last block (``linear_kv_down_proj``'s 576 rows);
  a weight TE kept dense gets the dequantized stored values.

Fused and sharded tensors keep whole blocks: Megatron's ``linear_fc1`` is ``cat[gate; up]`` (gate rows a
multiple of b), and a TP shard of a split dimension must be a multiple of b (vLLM asks the same,
``validate_fp8_block_shape``); ``block_shard`` slices data and scales together and names the tensor when
the layout breaks a block.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from glm5_mcore.checkpoint.fp8 import is_quantized, quantize_fp8_blocks, scale_shape
from glm5_mcore.checkpoint.hf_io import FP8_BLOCK, dequantize_fp8_blocks
from glm5_mcore.checkpoint.hf_names import hf_source, tp_slice

BASE_DTYPES = (None, "fp8")
"""``model.base_dtype``: None (the trainer's parameter dtype) or "fp8" (this module)."""
PARAM_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel",
               "shared", "is_embedding_or_output_parameter")
"""Megatron's partition / reduction attributes a replaced weight keeps."""

_aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------
# The storage (local spec)
# --------------------------------------------------------------------------------------------------
class BlockFP8Weight(torch.Tensor):
    """A frozen weight ``[M, N]`` as ``data`` (e4m3 ``[M, N]``) + ``scale_inv`` (fp32 ``[ceil(M/b), ceil(N/b)]``).

    Reports ``dtype`` (the trainer's) and the logical shape (``[N, M]`` for the transposed view ``.t()``
    makes for ``x @ W.t()``); ``requires_grad`` is always False."""

    data_fp8: torch.Tensor
    scale_inv: torch.Tensor
    block: int
    transposed: bool

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype,
                transposed: bool = False):
        shape = tuple(data.shape[::-1]) if transposed else tuple(data.shape)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype,
                 transposed: bool = False):
        if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
            raise ValueError(f"BlockFP8Weight: data must be a 2-D float8_e4m3fn tensor, got {data.dtype}"
                             f"{list(data.shape)}")
        if tuple(scale_inv.shape) != scale_shape(tuple(data.shape), block):
            raise ValueError(f"BlockFP8Weight: scale {list(scale_inv.shape)} does not tile a {list(data.shape)} "
                             f"weight in {block}x{block} blocks")
        self.data_fp8, self.scale_inv, self.block, self.transposed = data, scale_inv.float(), block, transposed

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"BlockFP8Weight(shape={list(self.shape)}, dtype={self.dtype}, block={self.block}, "
                f"device={self.device})")

    def __tensor_flatten__(self):
        return ["data_fp8", "scale_inv"], (self.block, self.dtype, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return BlockFP8Weight(inner["data_fp8"], inner["scale_inv"], *ctx)

    def __reduce_ex__(self, proto):
        raise TypeError("BlockFP8Weight is not pickled: save the base as the checkpoint stores it "
                        "(data + weight_scale_inv)")

    @property
    def nbytes_stored(self) -> int:
        """What it holds: 1 byte per element + 4 per block."""
        return self.data_fp8.numel() + 4 * self.scale_inv.numel()

    def _new(self, data=None, scale=None, dtype=None, transposed=None) -> "BlockFP8Weight":
        return BlockFP8Weight(self.data_fp8 if data is None else data, self.scale_inv if scale is None else scale,
                              self.block, self.dtype if dtype is None else dtype,
                              self.transposed if transposed is None else transposed)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The logical weight in ``dtype`` (default: the reported one), dequantized per block in fp32."""
        w = dequantize_fp8_blocks(self.data_fp8, self.scale_inv, self.block)
        w = w.t() if self.transposed else w
        return w.to(self.dtype if dtype is None else dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func._schema.is_mutable and args and isinstance(args[0], BlockFP8Weight):
            raise RuntimeError(f"{func}: a frozen FP8 base weight is read-only (model.base_dtype=fp8 keeps the "
                               "checkpoint's bytes; merge adapters at export: glm5 lora export --merged)")
        # any other read: the op on the dequantized weight (plain tensors out)
        return func(*[_dense(a) for a in args], **{k: _dense(v) for k, v in kwargs.items()})


def _dense(x):
    if isinstance(x, BlockFP8Weight):
        return x.dequantize()
    if isinstance(x, (list, tuple)):
        return type(x)(_dense(v) for v in x)
    return x


def _reference_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` where either side may be a ``BlockFP8Weight``: its blocks dequantized in fp32, the product in
    the other operand's dtype (the reference GEMM of the local spec)."""
    other = b if isinstance(a, BlockFP8Weight) else a
    dtype = other.dtype
    a = a.dequantize(dtype) if isinstance(a, BlockFP8Weight) else a
    b = b.dequantize(dtype) if isinstance(b, BlockFP8Weight) else b
    return torch.mm(a, b)


def _addmm(bias, a, b, beta=1, alpha=1):
    out = _reference_mm(a, b)
    return torch.add(bias, out, alpha=alpha) if beta == 1 else beta * bias + alpha * out


def _to_copy(w: BlockFP8Weight, dtype=None, device=None, **_):
    """``.to(dtype)`` changes the dtype it computes in; ``.to(device)`` moves the stored bytes."""
    if device is not None and torch.device(device) != w.device:
        return w._new(data=w.data_fp8.to(device), scale=w.scale_inv.to(device), dtype=dtype)
    return w._new(dtype=dtype)


def _transpose(w: BlockFP8Weight, *dims):
    if dims and sorted(d % 2 for d in dims) != [0, 1]:
        raise RuntimeError(f"BlockFP8Weight: transpose{dims} of a 2-D weight")
    return w._new(transposed=not w.transposed)


def _same(w: BlockFP8Weight, *_, **__):
    return w._new()


def _view(w: BlockFP8Weight, size, *_):
    if tuple(size) in (tuple(w.shape), (-1, w.shape[1]), (w.shape[0], -1)):
        return w._new()
    return w.dequantize().view(size)


_HANDLERS = {
    _aten.mm.default: _reference_mm,
    _aten.addmm.default: _addmm,
    _aten.t.default: _transpose,
    _aten.transpose.int: _transpose,
    _aten.numpy_T.default: _transpose,
    _aten.detach.default: _same,
    _aten.alias.default: _same,
    _aten.view.default: _view,
    _aten._unsafe_view.default: _view,
    _aten._to_copy.default: _to_copy,
    _aten.is_same_size.default: lambda a, b: tuple(a.shape) == tuple(b.shape),
}


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a parameter's bytes live in: a ``BlockFP8Weight``'s e4m3 data and scales, a TE
    quantized weight's row- and column-wise data and scales, else the parameter itself (what an offload
    moves, ``glm5_mcore.device.HostCopy``)."""
    if isinstance(t, BlockFP8Weight):
        return [t.data_fp8, t.scale_inv]
    if is_te_quantized(t):
        return [x for x in (getattr(t, k, None) for k in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                                                          "_columnwise_scale_inv")) if x is not None]
    return [t]


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a parameter holds (``stored_tensors``)."""
    return sum(x.numel() * x.element_size() for x in stored_tensors(t))


# --------------------------------------------------------------------------------------------------
# Which weights, and the block layout of fused / sharded tensors
# --------------------------------------------------------------------------------------------------
def is_fp8_base_weight(mcore_name: str, num_hidden_layers: int) -> bool:
    """Whether the Megatron parameter ``mcore_name`` is a linear the release stores in FP8 (every HF tensor
    it is made of is ``checkpoint.fp8.is_quantized``)."""
    if not mcore_name.endswith(".weight") and ".weight" not in mcore_name.rsplit(".", 1)[-1]:
        return False
    try:
        names = hf_source(mcore_name, num_hidden_layers).names
    except KeyError:
        return False
    return all(is_quantized(n.replace("{e}", "0")) for n in names)


def fp8_base_linears(model: torch.nn.Module, num_hidden_layers: int) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """(parameter name, module, attribute) of every frozen-base weight the FP8 base holds in FP8."""
    for mod_name, mod in model.named_modules():
        for attr, p in list(mod.named_parameters(recurse=False)):
            name = f"{mod_name}.{attr}" if mod_name else attr
            if ".lora." in f".{name}" or p.dim() != 2:
                continue
            if is_fp8_base_weight(name, num_hidden_layers):
                yield name, mod, attr


def block_shard(q: torch.Tensor, s: torch.Tensor, block: int, param: torch.Tensor, tp_rank: int, tp_size: int,
                is_glu: bool, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (data, scales) of a full (data ``[M, N]``, scales) pair, by Megatron's partition
    attributes on ``param``; a shard or gated half that would cut a block is a ValueError naming ``name``."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return q, s
    dim = param.partition_dim
    parts = 2 if (is_glu and dim == 0) else 1
    length = q.shape[dim] // parts // tp_size
    if length % block:
        raise ValueError(f"{name}: a TP shard of {length} {'rows' if dim == 0 else 'columns'} (TP {tp_size}) cuts "
                         f"the {block}x{block} FP8 blocks; use a TP size whose shards are multiples of {block}")
    return tp_slice(q, dim, tp_rank, tp_size, is_glu).contiguous(), tp_slice(s, dim, tp_rank, tp_size, is_glu).contiguous()


def fuses_whole_blocks(parts: int, gate_rows: int, block: int) -> bool:
    """Whether a weight made of ``parts`` HF tensors (2: gated ``[gate; up]``) can be fused in FP8: a gate
    half of ``gate_rows`` rows that are not whole ``block``-row blocks would be cut by the fused weight."""
    return parts == 1 or gate_rows % block == 0


def fuse_blocks(parts: list[tuple[torch.Tensor, torch.Tensor]], block: int, name: str):
    """``cat[gate; up]`` of (data, scales) pairs on dim 0; the gate's rows must be whole blocks."""
    if len(parts) == 1:
        return parts[0]
    (qg, sg), (qu, su) = parts
    if not fuses_whole_blocks(2, qg.shape[0], block):
        raise ValueError(f"{name}: the gate half has {qg.shape[0]} rows, not a multiple of the {block}-row FP8 "
                         "block: its fused [gate; up] weight would cut a block")
    return torch.cat([qg, qu]), torch.cat([sg, su])


def stored_or_quantized(t: torch.Tensor, scale: Optional[torch.Tensor], block: int, name: str):
    """(data, scales) of one HF tensor: as stored when it is FP8 (scales checked against ``block``), else
    quantized once with the release's block scheme (``checkpoint.fp8.quantize_fp8_blocks``)."""
    if scale is None:
        return quantize_fp8_blocks(t, block)
    if t.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: stored as {t.dtype}; the FP8 base takes float8_e4m3fn")
    if tuple(scale.shape) != scale_shape(tuple(t.shape), block):
        raise ValueError(f"{name}_scale_inv: shape {list(scale.shape)} does not tile {list(t.shape)} in the folder's "
                         f"{block}x{block} blocks (quantization_config.weight_block_size)")
    return t, scale.float()


# --------------------------------------------------------------------------------------------------
# Putting it into a built model
# --------------------------------------------------------------------------------------------------
def is_te_quantized(t: torch.Tensor) -> bool:
    return getattr(t, "_rowwise_data", None) is not None or getattr(t, "_columnwise_data", None) is not None


def te_tiles(shape: tuple, block: int = FP8_BLOCK) -> bool:
    """Whether TE's blockwise kernels take a weight of ``shape``: both dimensions whole 128-blocks."""
    return block == FP8_BLOCK and shape[0] % block == 0 and shape[1] % block == 0


def apply_fp8_base(model: torch.nn.Module, num_hidden_layers: int, block: int = FP8_BLOCK,
                   only: Optional[set[str]] = None) -> int:
    """Give every FP8-base weight of ``model`` (built with the local spec; ``only``: those of these names) a
    ``BlockFP8Weight`` of its shape (zeros until ``load_block_fp8_`` fills it; the dense weight is freed),
    frozen, Megatron's attributes kept. TE FP8 weights (built under ``fp8_param``) are left as they are.
    Returns #weights."""
    n = 0
    for name, mod, attr in list(fp8_base_linears(model, num_hidden_layers)):
        if only is not None and name not in only:
            continue
        p = getattr(mod, attr)
        if is_te_quantized(p) or isinstance(p, BlockFP8Weight) or "transformer_engine" in type(mod).__module__:
            continue  # TE's own modules: FP8 as TE built them, or dense where TE kept them so
        M, N = p.shape
        data = torch.zeros(M, N, dtype=torch.float8_e4m3fn, device=p.device)
        scale = torch.ones(scale_shape((M, N), block), dtype=torch.float32, device=p.device)
        new = torch.nn.Parameter(BlockFP8Weight(data, scale, block, p.dtype), requires_grad=False)
        for k in PARAM_ATTRS:
            if hasattr(p, k):
                setattr(new, k, getattr(p, k))
        setattr(mod, attr, new)
        n += 1
    return n


@torch.no_grad()
def load_block_fp8_(param: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: int, name: str) -> None:
    """Write stored (data ``[M, N]`` e4m3, scales) into a built FP8-base weight: a ``BlockFP8Weight`` (its
    bytes), a TE ``Float8BlockwiseQTensor`` (row-wise data + the 2-D scales; TE pads scale columns to a
    multiple of 4), or a dense weight (TE could not tile it: the dequantized values)."""
    if tuple(q.shape) != tuple(param.shape):
        raise ValueError(f"{name}: FP8 weight {list(q.shape)}, the model expects {list(param.shape)} on this rank")
    if isinstance(param, BlockFP8Weight):
        if param.block != block:
            raise ValueError(f"{name}: the model was built for {param.block}x{param.block} FP8 blocks, the "
                             f"checkpoint has {block}x{block}")
        param.data_fp8.copy_(q)
        param.scale_inv.copy_(s)
        return
    if is_te_quantized(param):
        if block != FP8_BLOCK:
            raise ValueError(f"{name}: Transformer Engine's blockwise recipe takes {FP8_BLOCK}x{FP8_BLOCK} blocks, "
                             f"the checkpoint has {block}x{block}")
        param._rowwise_data.view(torch.uint8).copy_(q.view(torch.uint8))
        param._rowwise_scale_inv.zero_()
        param._rowwise_scale_inv[: s.shape[0], : s.shape[1]].copy_(s)
        if param._columnwise_data is not None:
            param._create_columnwise()  # the exact transpose of data and scales (2-D blocks)
        return
    param.copy_(dequantize_fp8_blocks(q, s, block).to(param.dtype))


def check_base_dtype(base_dtype: Optional[str], trains_base: bool, field: str = "model.base_dtype") -> None:
    """``model.base_dtype`` is None or "fp8", and "fp8" only when the base stays frozen (LoRA)."""
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"{field}={base_dtype!r}: expected null (the trainer's dtype) or fp8")
    if base_dtype == "fp8" and trains_base:
        raise ValueError(f"{field}=fp8 keeps the frozen base in the checkpoint's FP8 bytes, which full fine-tuning "
                         "would have to update: set lora.enabled=true (LoRA) or model.base_dtype=null")
