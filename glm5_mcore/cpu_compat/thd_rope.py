"""The unfused RoPE of packed (THD) sequences in one pass (installed by ``glm5_mcore.cpu_compat.apply``)."""

from __future__ import annotations

import functools

import torch


def thd_rope_in_one_pass() -> None:
    """rope_utils.py:252-268: the unfused RoPE of packed (THD) sequences, the path without
    ``apply_rope_fusion`` (TE's fused kernel: CUDA), splits ``t`` [T, h, d] at ``cu_seqlens`` and applies
    RoPE one sequence at a time, six small ops per sequence; MLA and the DSA indexer call it four times a
    layer, so with 128 packed rollouts it was two thirds of the tiny model's forward. The same positions in
    one pass: each token's position in its own sequence (on CP rank r of c, the zigzag halves of
    rope_utils.py:140-180: ``r·s/2 + j``, then ``2c·s/2 - (r+1)·s/2 + j``), its ``freqs`` row gathered, and
    Megatron-Core's own ``_apply_rotary_pos_emb_bshd`` over all T tokens at once, reading nothing back from
    the device. The other case (``freqs`` given per packed token, rope_utils.py:232-250: as many rows as the
    pack, T·c) is already one pass and goes to Megatron-Core's code."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    thd = rope_utils._apply_rotary_pos_emb_thd
    bshd = rope_utils._apply_rotary_pos_emb_bshd

    @functools.wraps(thd)
    def apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False,
                                 mscale=1.0, cp_group=None, multi_latent_attention=None):
        if cp_group is None or multi_latent_attention is not None or freqs.size(0) == t.size(0) * cp_group.size():
            return thd(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                       mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale, cp_group=cp_group,
                       multi_latent_attention=multi_latent_attention)
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long() // cp_size
        starts = torch.cumsum(lens, 0) - lens
        j = torch.arange(t.size(0), device=lens.device) - torch.repeat_interleave(starts, lens, output_size=t.size(0))
        if cp_size > 1:
            half = torch.repeat_interleave(lens // 2, lens, output_size=t.size(0))
            j = torch.where(j < half, cp_rank * half + j, (2 * cp_size - cp_rank - 1) * half + j - half)
        out = bshd(t.unsqueeze(1), freqs[j.to(freqs.device)], rotary_interleaved=rotary_interleaved,
                   mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale)
        return out.squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
    rotary_pos_embedding._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
