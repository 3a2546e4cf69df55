"""The FP8 steps of ``glm5 convert`` and ``glm5 lora export --merged``: a frozen base the HF folder stores in
FP8 stays FP8 in our checkpoint, and goes back out as the same bytes (``checkpoint.fp8_sharded`` is the
checkpoint format: ``{key}`` e4m3 + ``{key}_scale_inv`` fp32 block scales, ``fp8_base_block`` in the common
state).

- hf-to-mcore (``keep_fp8``): each Megatron weight the release stores in FP8 (``fp8_linear.is_fp8_base_weight``)
  whose HF tensors the folder holds all as e4m3 with block scales becomes a ``BlockFP8Weight`` on the meta
  model, so Megatron-Core's save writes its stored pair; ``stored_part`` reads the e4m3 bytes or the scales
  of one HF tensor as stored. Anything else (a dense folder, ``--dequantize-fp8``) converts as before.
- mcore-to-hf (``stored_fp8_names``, ``stored_parts``): the stored pairs are read as they are and written back
  as they are where the output keeps FP8 (``out_dtypes.OutputDtypes.stored_tensors``: the source folder's
  bytes, bit for bit), dequantized per block where it asks for bf16 / fp32.
- merged export (``merged_weight``, the one FP8 merge step): dequantize per block in fp32, add the adapter's
  ``scale·B·A``, and the writer re-quantizes each HF tensor with the release's block scheme (scales from the
  merged weight's own block maxima): the merge comes before the quantization, never onto FP8 values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.checks import check_finite_fp8
from glm5_mcore.checkpoint.fp8 import scale_shape
from glm5_mcore.checkpoint.folder_config import notice
from glm5_mcore.checkpoint.fp8_sharded import SCALE_SUFFIX, stored_block
from glm5_mcore.checkpoint.megatron_lm import dcp_metadata
from glm5_mcore.checkpoint.hf_io import FP8, HFCheckpoint, dequantize_fp8_blocks
from glm5_mcore.checkpoint.hf_names import hf_source
from glm5_mcore.model.fp8_linear import BlockFP8Weight, apply_fp8_base, fuses_whole_blocks, is_fp8_base_weight


# --------------------------------------------------------------------------------------------------
# hf-to-mcore
# --------------------------------------------------------------------------------------------------
def keep_fp8(model, tensors: dict[str, torch.Tensor], num_hidden_layers: int, ckpt: HFCheckpoint) -> int:
    """Make each weight of the meta ``model`` that the folder stores in FP8 a ``BlockFP8Weight`` in the
    folder's block size (every HF tensor it is made of e4m3 with a ``weight_scale_inv``). A gated weight whose
    gate rows are not whole blocks converts dense instead (said on stderr): Megatron's fused ``[gate; up]``
    would cut a block (``fp8_linear.fuse_blocks``). Returns #weights."""
    names, dense = set(), []
    for name in tensors:
        if not is_fp8_base_weight(name, num_hidden_layers):
            continue
        hf = hf_source(name, num_hidden_layers).names
        if all(h in ckpt and ckpt.info(h)[1] in FP8 and ckpt.stored_names_for(h)[-1].endswith(SCALE_SUFFIX)
               for h in hf):
            for h in hf:  # checked from the headers, before anything is written
                path, _, shape, _ = ckpt.info(h)
                scale = ckpt.info(h + SCALE_SUFFIX)[2]
                if tuple(scale) != scale_shape(tuple(shape), ckpt.block):
                    raise ValueError(f"{path}: tensor {h}{SCALE_SUFFIX} has shape {list(scale)}, which does not tile "
                                     f"{list(shape)} in the folder's {ckpt.block}x{ckpt.block} blocks "
                                     "(quantization_config.weight_block_size)")
            rows = ckpt.info(hf[0])[2][0]
            if not fuses_whole_blocks(len(hf), rows, ckpt.block):
                dense.append(f"{'+'.join(hf)} ({rows} gate rows)")
                continue
            names.add(name)
    if dense:
        notice(f"{ckpt.dir}: {len(dense)} gated weight(s) stored dense (dequantized per block), not FP8: the gate "
               f"half's rows are not whole {ckpt.block}-row blocks, so [gate; up] fused as Megatron holds it would "
               f"cut a block ({dense[0]}{', ...' if len(dense) > 1 else ''}); an FP8 export re-quantizes them")
    return apply_fp8_base(model, num_hidden_layers, ckpt.block, only=names) if names else 0


def stored_ids(tensors: dict[str, torch.Tensor]) -> dict[int, tuple[str, str]]:
    """id of each ``BlockFP8Weight``'s e4m3 data / scales → (Megatron name, "data" or "scale"): what the save's
    write items are views of."""
    out = {}
    for name, t in tensors.items():
        if isinstance(t, BlockFP8Weight):
            out[id(t.data_fp8)], out[id(t.scale_inv)] = (name, "data"), (name, "scale")
    return out


def stored_part(ckpt: HFCheckpoint, hf_name: str, part: str, allow_nonfinite: bool) -> torch.Tensor:
    """The e4m3 bytes (``part="data"``) or the block scales (``"scale"``) of ``hf_name`` as the folder stores
    them; NaN bytes or scales are an error naming the tensor and file."""
    q, s = ckpt.get_stored(hf_name)
    if s is None or tuple(s.shape) != scale_shape(tuple(q.shape), ckpt.block):
        raise ValueError(f"{ckpt.files[ckpt.locate(hf_name)[0]]}: tensor {hf_name}: block scales "
                         f"{None if s is None else list(s.shape)} do not tile {list(q.shape)} in the folder's "
                         f"{ckpt.block}x{ckpt.block} blocks (quantization_config.weight_block_size)")
    if not allow_nonfinite:
        check_finite_fp8(q, s, hf_name, ckpt.files[ckpt.locate(hf_name)[0]])
    return q if part == "data" else s.float()


# --------------------------------------------------------------------------------------------------
# mcore-to-hf
# --------------------------------------------------------------------------------------------------
def stored_fp8_names(sharded: dict, model_path: Path) -> tuple[dict[str, int], Optional[int]]:
    """({Megatron name: block} of the weights the checkpoint stores in FP8, the block or None)."""
    md = dcp_metadata(model_path)
    names = [n for n, e in sharded.items() if getattr(e, "key", None) is not None and e.key + SCALE_SUFFIX in md]
    if not names:
        return {}, None
    block = stored_block(model_path)
    return {n: block for n in names}, block


def stored_nbytes(t: torch.Tensor, block: Optional[int]) -> int:
    """Bytes of a Megatron tensor as the checkpoint stores it: e4m3 + its scales when ``block``, else dense."""
    if block is None:
        return t.numel() * t.element_size()
    return t.numel() + 4 * scale_shape(tuple(t.shape), block)[0] * scale_shape(tuple(t.shape), block)[1]


def stored_parts(q, s, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (e4m3, scales) of each of the ``n`` HF tensors one stored Megatron weight is made of: a GLU weight's
    gate and up halves (as loaded, or split on dim 0: the gate's rows are whole blocks), else the weight."""
    if isinstance(q, (list, tuple)):
        if len(q) == n:
            return list(zip(q, s))
        q, s = torch.cat(list(q), 0), torch.cat(list(s), 0)
    if n == 1:
        return [(q, s)]
    return list(zip(q.chunk(n, 0), s.chunk(n, 0)))


def merged_weight(pairs: list[tuple[torch.Tensor, torch.Tensor]], block: int, delta: torch.Tensor) -> torch.Tensor:
    """The FP8 merge step: the stored weight dequantized per block in fp32 (its HF parts fused as Megatron holds
    them) plus the adapter's ``delta``; the writer re-quantizes it per HF tensor (``OutputDtypes.tensors``)."""
    w = torch.cat([dequantize_fp8_blocks(q, s, block) for q, s in pairs], 0)
    return w + delta.float()
