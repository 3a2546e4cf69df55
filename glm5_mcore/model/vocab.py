"""The vocabulary padded for tensor parallelism, as Megatron-LM pads it, and kept out of every number.

At TP > 1 the embedding and the output layer are split by vocabulary rows, so a vocabulary TP does not divide
(a fine-tuned tokenizer's added tokens) is padded to ``mcore_settings.padded_vocab_size`` rows (Megatron-LM's
``make_vocab_size_divisible_by`` × TP) and the GPTModel is built at that size (``build_model``). The rows past
the real vocabulary never carry meaning:

- ``mask_padded_logits``: a forward hook on the output layer sets the padded columns of its logits
  [s, b, V_pad/TP] (or gathered [s, b, V_pad]) to -inf, so every consumer — the SFT and MTP cross entropy
  (Megatron's ``vocab_parallel_cross_entropy``), RL's vocab-parallel log-probs and entropy
  (``model.mtp_loss.token_logprobs``), the MTP draft argmax — sees the HF model's distribution over the
  real vocabulary, and the padded output rows get zero gradient;
- ``pad_vocab_rows``: the HF ``embed_tokens`` / ``lm_head`` [V, H] with zero rows appended to [V_pad, H]
  before it is sliced to a rank (``checkpoint.hf_load``); Megatron-LM's converter repeats the last row
  instead, which the mask makes irrelevant;
- ``real_vocab_size``: V of a built model (``forward_logits`` returns [..., V]).

Checkpoints store what Megatron-Core's save writes, the padded rows of the saving layout; its loader reads
the embedding and output layer with ``allow_shape_mismatch`` (zero-filled, then the stored rows that overlap),
so a checkpoint loads at any TP, padded or not, and ``glm5 convert mcore-to-hf`` (built at TP 1, unpadded)
writes the real V rows only.
"""

from __future__ import annotations

import torch

VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The Megatron tensors split by vocabulary rows (dim 0)."""


def real_vocab_size(model) -> int:
    """The vocabulary of the HF model behind ``model`` (a GLM-5 ``GPTModel``; DDP unwrapped): V, not V_pad."""
    inner = getattr(model, "module", model)
    return inner.config.glm5.vocab_size


def pad_vocab_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """``full`` [V, ...] with zero rows appended up to ``rows`` (V_pad); ``full`` itself when it has them."""
    if full.shape[0] >= rows:
        return full
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])], 0)


def mask_padded_logits(model, vocab_size: int):
    """Make ``model.output_layer``'s padded logit columns -inf (in place, after its matmul: no copy of the
    logits; autograd gives those columns zero gradient). A no-op hook on a rank holding no padded column;
    None when the model is not padded. Returns the hook handle."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    layer = model.output_layer
    padded = model.vocab_size
    if padded == vocab_size:
        return None
    tp_rank, tp = get_pg_rank(layer.tp_group), get_pg_size(layer.tp_group)
    local = padded // tp

    def hook(_mod, _args, out):
        logits = out[0]
        n = logits.shape[-1]
        start = 0 if n == padded else tp_rank * local  # gathered output (gather_output / runtime_gather_output)
        first = max(0, vocab_size - start)
        if first < n:
            logits[..., first:] = float("-inf")
        return None

    return layer.register_forward_hook(hook)
