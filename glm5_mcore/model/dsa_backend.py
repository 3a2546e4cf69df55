"""Megatron-Core's fused DSA kernels behind ``config.dsa_kernel_backend``, with the constraints checked
before any work and the top-k adapted to this project's contract.

``model.dsa_kernel_backend``: ``auto`` (the default: ``tilelang`` on CUDA where the model meets the fused
kernels' constraints, else ``none``, said once at start-up: ``choose``), ``none``, ``tilelang`` or ``cudnn``
(explicit: a model the kernels cannot run is refused in one line, ``check``). The value is Megatron-Core's own ``TransformerConfig`` field
(``transformer_config.py:326``); the cores call its backend hooks
(``experimental_attention_variant/dsa_kernels.py``): ``run_fused_qk_topk`` (indexer scores + top-k),
``run_fused_qk_topk_with_loss`` (the same + the sparse-stage KL) and
``run_fused_absorbed_sparse_attention`` (SparseMLA forward + backward over the 576-wide latent).
``none`` keeps this project's kernels: the fused C++ ones on the CPU (``glm5_mcore.kernels``), the
sync-free PyTorch path on any other device.

The top-k contract (``docs/dsa.md``): this project selects, per query row, the K largest indexer
scores with ties going to the lower key index, returned ascending, then -1 where fewer than K keys
are allowed. TileLang's fused indexer (``ops/tilelang_dsa.py:215-289``) scores bf16 inputs with its
own fp32 accumulation, then takes ``torch.topk(logits, K, sorted=False)`` (``ops/indexer.py:26-41``)
and writes -1 over indices outside a row's [start, end) (``_sanitize_fused_topk_indices``). This
module puts that output into the contract's order (ascending, -1 last) without a host read; the set
itself can differ where the K-th score is tied (or within rounding of tied) beyond the set, which
``CONTRACT_NOTICE`` says once at start-up.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Optional

import torch
from megatron.core.transformer.experimental_attention_variant import dsa_kernels

SETTING = "model.dsa_kernel_backend"
BACKENDS = ("auto", "none", "tilelang", "cudnn")
SPARSE_MLA_DIMS = (512, 64)  # kv_lora_rank, rope dim: the TileLang SparseMLA kernels are built for 576 = 512 + 64

CONTRACT_NOTICE = (
    "DSA top-k on the fused {backend} indexer: the same sets as the CPU reference except in rows whose K-th "
    "score is tied (or within bf16 rounding of tied) beyond the set, where torch.topk on CUDA picks, not the "
    "lower key index; RL's trainer recomputes its own top-k (frozen indexer by default), IcePop masks tokens "
    "whose rollout/trainer ratio such a flip moves out of bounds, and model.dsa_kernel_backend=none restores the "
    "exact rule (docs/dsa.md)")

_noticed: set = set()


PACKAGES = {"tilelang": (("tilelang", None),), "cudnn": (("flash_mla", "flash_mla_sparse_fwd"), ("cudnn", "DSA"))}
"""What each backend imports, (module, name it must export): Megatron-Core's
``utils._missing_{tilelang,cudnn}_dsa_kernel_dependencies`` checks the same when the config is built
(``from flash_mla import flash_mla_sparse_fwd``, ``from cudnn import DSA``: utils.py:510-519), without naming
our setting."""


def missing_packages(backend: str) -> list[str]:
    """The packages of ``backend`` that do not import. OSError too: TileLang loads native libraries with
    ``ctypes.CDLL`` and a missing one raises it (Megatron-Core catches both, ``dsa_kernels.py:59``)."""
    out = []
    for mod, name in PACKAGES.get(backend, ()):
        try:
            m = importlib.import_module(mod)
            if name is not None:
                getattr(m, name)
        except (ImportError, OSError, AttributeError):
            out.append(mod if name is None else f"{mod}.{name}")
    return out


def resolve(name: str, device: torch.device | str) -> str:
    """The backend a model of any widths could get: ``auto`` → ``tilelang`` on CUDA when TileLang is installed
    (else ``none``, with a warning), ``none`` elsewhere; ``choose`` then keeps it only for a model the kernels
    can run. ValueError (one line naming the setting) for an unknown name, a fused backend off CUDA, or its
    packages missing."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"{SETTING}: {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "auto":
        if device.type != "cuda":
            return "none"
        if missing_packages("tilelang"):
            warnings.warn(f"{SETTING}=auto: TileLang is not installed (pip install 'glm5-mcore[gpu]'), so DSA "
                          "runs the PyTorch path on CUDA, far slower than the fused kernels", stacklevel=2)
            return "none"
        return "tilelang"
    if name != "none" and device.type != "cuda":
        raise ValueError(f"{SETTING}={name}: fused DSA kernels run on CUDA only, the training device is "
                         f"{device.type}; use auto or none")
    if missing_packages(name):
        raise ValueError(f"{SETTING}={name}: missing {', '.join(missing_packages(name))} (tilelang: pip install "
                         "'glm5-mcore[gpu]'; cudnn: flash_mla and nvidia-cudnn-frontend[cutedsl]); or use none")
    return name


def active(config) -> bool:
    """Whether the cores call the fused hooks (a backend other than ``none``, attention not forced unfused)."""
    return dsa_kernels.use_fused_dsa_kernels(config)


def problems(config, tp: int, trains_indexer: bool = False, package_check: bool = True,
             backend: Optional[str] = None) -> list[str]:
    """What keeps ``backend`` (default: the config's) from running this model's DSA layers, one phrase each
    ([] where it can). TileLang: bf16 weights, top-k a multiple of 64, heads per TP rank a power of two (its
    kernels pad fewer than 16), the 512 + 64 latent, an indexer head count its backward supports (when the
    indexer trains). cuDNN: bf16 and the 512 + 64 latent (FlashMLA's sparse kernels); its own head and top-k
    limits are Megatron-Core's to decline per call (the hooks return None and the PyTorch path runs).
    Either: the packages importable."""
    backend = backend or getattr(config, "dsa_kernel_backend", "none")
    if backend == "none":
        return []
    heads = config.num_attention_heads // max(1, tp)
    kernel_heads = max(heads, 16)
    out = []
    if config.params_dtype != torch.bfloat16:
        out.append(f"weights are {str(config.params_dtype).replace('torch.', '')}, the kernels take bf16")
    if backend == "tilelang" and config.dsa_indexer_topk % 64:
        out.append(f"index_topk {config.dsa_indexer_topk} is not a multiple of 64")
    if backend == "tilelang" and kernel_heads & (kernel_heads - 1):
        out.append(f"{heads} attention heads per TP rank is not a power of two")
    if (config.kv_lora_rank, config.qk_pos_emb_head_dim) != SPARSE_MLA_DIMS:
        out.append(f"kv_lora_rank + qk_rope_head_dim = {config.kv_lora_rank} + {config.qk_pos_emb_head_dim}, "
                   "the SparseMLA kernels are built for 512 + 64")
    n_i = config.dsa_indexer_n_heads
    if backend == "tilelang" and trains_indexer and (n_i > 64 or n_i % 8):
        out.append(f"index_n_heads {n_i}: the fused indexer backward takes a multiple of 8 up to 64")
    if package_check and not out and missing_packages(backend):
        out.append(f"missing {', '.join(missing_packages(backend))} (pip install 'glm5-mcore[gpu]')")
    return out


def check(config, tp: int, trains_indexer: bool = False, package_check: bool = True) -> None:
    """Refuse, before any work, a layer the selected fused kernels cannot run (``problems``): ValueError
    naming ``model.dsa_kernel_backend`` and the fields."""
    found = problems(config, tp, trains_indexer, package_check)
    if found:
        backend = config.dsa_kernel_backend
        raise ValueError(f"{SETTING}={backend}: " + "; ".join(found) + " (set it to none for the PyTorch path)")


def choose(name: str, resolved: str, config, tp: int, trains_indexer: bool) -> str:
    """The backend a model is built with: ``resolved`` (``resolve``'s answer) unless ``name`` is ``auto`` and
    the model does not meet the fused kernels' constraints (``problems``: a tiny or fp32 model), where the
    PyTorch path runs instead — said once per process and reason, as Megatron-Core's hooks decline what they
    cannot run (``ops/tilelang_dsa.py:771-796``). An explicit backend is kept (``check`` refuses it later)."""
    if name != "auto" or resolved == "none":
        return resolved
    found = problems(config, tp, trains_indexer, backend=resolved)
    if not found:
        return resolved
    msg = (f"{SETTING}=auto: the PyTorch DSA path, not {resolved}: " + "; ".join(found)
           + f" ({SETTING}={resolved} refuses such a model instead)")
    if msg not in _noticed:
        _noticed.add(msg)
        warnings.warn(msg, stacklevel=2)
    return "none"


def select(name: str, device, make_config, tp: int):
    """The Megatron-Core config a model is built with: ``make_config(backend)`` for the backend ``resolve`` and
    ``choose`` settle on (``auto``: judged on the config built with ``none``, then rebuilt with the fused
    backend where the model meets its constraints; trains_indexer: ``dsa_indexer_loss_coeff > 0``)."""
    resolved = resolve(name, device)
    if name != "auto" or resolved == "none":
        return make_config(resolved)
    cfg = make_config("none")
    backend = choose(name, resolved, cfg, tp, trains_indexer=(cfg.dsa_indexer_loss_coeff or 0.0) > 0)
    return cfg if backend == "none" else make_config(backend)


def notice(config) -> None:
    """Say once per process where the fused top-k may differ from the contract (``CONTRACT_NOTICE``)."""
    backend = config.dsa_kernel_backend
    if backend not in _noticed:
        _noticed.add(backend)
        warnings.warn(CONTRACT_NOTICE.format(backend=backend), stacklevel=2)


def canonical_topk(idx_bSK: torch.Tensor, T: int) -> torch.Tensor:
    """A fused top-k ([b, S, K], int32, unordered, -1 anywhere) in the contract's order: each row
    ascending, then -1. Kept int32: the fused core reads it as is (no int64 copy of [S, K] per layer).
    No host read."""
    idx = torch.where(idx_bSK < 0, T, idx_bSK).sort(-1).values
    return idx.masked_fill_(idx == T, -1)


def block_rows(T: int, budget: int) -> int:
    """Query rows per fused indexer block: its fp32 [rows, T] logits stay within ``budget`` bytes."""
    return max(1, budget // max(1, 4 * T))


def fused_topk(config, q_SbnD, k_TbD, w_Sbn, topk: int, starts_S, ends_S, budget: int) -> Optional[torch.Tensor]:
    """``run_fused_qk_topk`` on bf16 inputs: int32 [b, S, K] in the contract's order, None if declined."""
    res = dsa_kernels.run_fused_qk_topk(config, q_SbnD.to(torch.bfloat16), k_TbD.to(torch.bfloat16), w_Sbn, topk,
                                        starts_S.to(torch.int32), ends_S.to(torch.int32),
                                        block_rows(k_TbD.shape[0], budget), use_relu=config.dsa_indexer_scoring_relu)
    return None if res is None else canonical_topk(res[0], k_TbD.shape[0])


def fused_topk_with_loss(config, q_SbnD, k_TbD, w_Sbn, topk: int, starts_S, ends_S, budget: int, query_SbnD,
                         key_TbnD, scale: float, coeff: float, pg_collection, valid_rows=None):
    """``run_fused_qk_topk_with_loss``: (top-k [b, S, K] in the contract's order, the coefficient-scaled
    sparse KL, differentiable w.r.t. the indexer's q, k, w) or None if declined. ``query``/``key`` are
    the main attention's (absorbed: [S, b, n, 576] and the shared latent [T, b, 1, 576]), detached."""
    res = dsa_kernels.run_fused_qk_topk_with_loss(
        config, q_SbnD.to(torch.bfloat16), k_TbD.to(torch.bfloat16), w_Sbn, topk, starts_S.to(torch.int32),
        ends_S.to(torch.int32), block_rows(k_TbD.shape[0], budget), query=query_SbnD.detach(),
        key=key_TbnD.detach(), softmax_scale=scale, loss_coeff=coeff, pg_collection=pg_collection,
        query_valid_rows=valid_rows, calculate_per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
        use_relu=config.dsa_indexer_scoring_relu)
    if res is None:
        return None
    return canonical_topk(res[0], k_TbD.shape[0]), res[2]


def fused_core(config):
    """The absorbed SparseMLA hook bound to ``config`` for ``absorbed_sparse_attention(fused=...)``."""

    def core(query, key, topk, scale, dc):
        return dsa_kernels.run_fused_absorbed_sparse_attention(config, query, key, topk.to(torch.int32), scale, dc)

    return core
