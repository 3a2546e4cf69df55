"""Fused CPU kernels for DSA (``dsa_cpu.cpp``), compiled on first use and called through ctypes.

On a CPU the sparse core and the indexer's top-k are memory-bound in PyTorch ops: the core
materialises a gathered [S, K, D] latent block per chunk and ``torch.topk`` with k = 512 costs more
than the indexer's whole T² scoring. The kernels read the latent rows in place and score + select
one indexer row at a time; the sparse stage's indexer loss (its attention target and the KL of the
indexer's scores over the selected keys, forward and gradients) reads the selected rows in place too.
They run only on CPU fp32 tensors; CUDA tensors never come here.

The library is built once per machine with the system C++ compiler (``$CXX`` or ``g++``,
``-O3 -march=native``) into ``$GLM5_KERNEL_CACHE`` (default ``~/.cache/glm5_mcore/kernels``), keyed by
the source, the compiler and the CPU's flags, written to a temporary file and renamed. Without a
compiler, or with ``GLM5_CPU_KERNELS=0``, ``available()`` is False (one warning) and ``dsa.py``
keeps its PyTorch path, which computes the same function.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

_SRC = Path(__file__).with_name("dsa_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-pthread"]
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_failed: Optional[str] = None
_enabled = os.environ.get("GLM5_CPU_KERNELS", "1") != "0"

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "glm5_topk_rows": [_P, _I, _I, _P, _P, _I, _I, _P, _N],
    "glm5_indexer_topk": [_P, _P, _P, _I, _I, _I, _I, _P, _P, _I, _P, _N],
    "glm5_sparse_latent_fwd": [_P, _P, _P, _I, _I, _I, _I, _F, _I, _P, _P, _N],
    "glm5_sparse_latent_bwd": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I, _P, _P, _N],
    "glm5_sparse_latent_target": [_P, _P, _P, _I, _I, _I, _I, _F, _P, _N],
    "glm5_indexer_kl": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _N],
}


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SRC.read_text(), version, " ".join(_FLAGS), _cpu_id()]).encode()).hexdigest()
    cache = Path(os.environ.get("GLM5_KERNEL_CACHE", Path.home() / ".cache" / "glm5_mcore" / "kernels"))
    so = cache / f"dsa_cpu-{key[:16]}.so"
    if so.exists():
        return so
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *_FLAGS, str(_SRC), "-o", tmp], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed on {_SRC}:\n{r.stderr[-2000:]}")
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
            try:
                if not cxx:
                    raise RuntimeError("no C++ compiler (set $CXX or install g++)")
                lib = ctypes.CDLL(str(_build(cxx)))
                for name, args in _SIGNATURES.items():
                    getattr(lib, name).argtypes = args
                    getattr(lib, name).restype = None
                _lib = lib
            except Exception as e:  # noqa: BLE001 - any build/load failure means "use PyTorch ops"
                _failed = str(e)
                warnings.warn(f"glm5_mcore CPU DSA kernels unavailable, using PyTorch ops: {e}")
    return _lib


def available() -> bool:
    """True when the kernels are enabled and built (building them on the first call)."""
    return _enabled and _load() is not None


@contextlib.contextmanager
def disabled():
    """Run the PyTorch path inside the block (tests compare the two)."""
    global _enabled
    old, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = old


def use_for(*tensors: torch.Tensor) -> bool:
    """Whether these tensors go through the kernels: all on CPU, kernels available."""
    return all(t.device.type == "cpu" for t in tensors) and available()


def _need() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"glm5_mcore CPU DSA kernels unavailable: {_failed}")
    return lib


def _c(t: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return t.detach().to(dtype).contiguous()


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def topk_rows(scores_RL: torch.Tensor, lo_R: torch.Tensor, hi_R: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """Per row r, the top-k of ``scores[r, lo[r]:hi[r]]`` (-inf / NaN never chosen; ties to the lower
    index) as ascending column indices + ``offset``, then -1 padding. int64 [R, k]."""
    s = _c(scores_RL)
    lo, hi = _c(lo_R, torch.int64), _c(hi_R, torch.int64)
    out = torch.empty(s.shape[0], k, dtype=torch.int64)
    _need().glm5_topk_rows(_ptr(s), s.shape[0], s.shape[1], _ptr(lo), _ptr(hi), k, offset, _ptr(out),
                        torch.get_num_threads())
    return out


def _padded(t: torch.Tensor, mult: int = 16) -> torch.Tensor:
    """fp32 contiguous copy of ``t`` with its last dim zero-padded to a multiple of ``mult`` (the
    vector kernels read whole 16-float vectors)."""
    t = _c(t)
    extra = -t.shape[-1] % mult
    return torch.nn.functional.pad(t, [0, extra]) if extra else t


def indexer_topk(q_SnD: torch.Tensor, k_TD: torch.Tensor, w_Sn: torch.Tensor, lo_S: torch.Tensor,
                 hi_S: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of I[t, u] = Σ_h w[t,h]·ReLU(q[t,h]·k[u]) over keys lo[t] ≤ u < hi[t], per query row
    (selection as ``topk_rows``). q [S, nI, dI], k [T, dI], w [S, nI] → int64 [S, k]."""
    q, w = _c(q_SnD), _c(w_Sn)
    kT = _padded(k_TD.t(), 64)  # [dI, Tp]
    lo, hi = _c(lo_S, torch.int64), _c(hi_S, torch.int64)
    S, nI, dI = q.shape
    out = torch.empty(S, k, dtype=torch.int64)
    _need().glm5_indexer_topk(_ptr(q), _ptr(kT), _ptr(w), S, nI, dI, kT.shape[1], _ptr(lo), _ptr(hi), k, _ptr(out),
                              torch.get_num_threads())
    return out


def sparse_latent_fwd(q_SnD: torch.Tensor, lat_TD: torch.Tensor, idx_SK: torch.Tensor, scale: float, dc: int):
    """Absorbed sparse attention forward: out [S, n, dc], lse [S, n] (fp32)."""
    q, lat, idx = _padded(q_SnD), _padded(lat_TD), _c(idx_SK, torch.int64)
    S, n, D = q.shape
    dcp = dc + (-dc % 16)
    out = torch.empty(S, n, dcp, dtype=torch.float32)
    lse = torch.empty(S, n, dtype=torch.float32)
    _need().glm5_sparse_latent_fwd(_ptr(q), _ptr(lat), _ptr(idx), S, n, D, idx.shape[1], scale, dcp, _ptr(out),
                                   _ptr(lse), torch.get_num_threads())
    return out[..., :dc], lse


def sparse_latent_bwd(q_SnD, lat_TD, idx_SK, out_Snc, lse_Sn, dout_Snc, scale: float, dc: int):
    """Absorbed sparse attention backward from the forward's out and lse: dq [S, n, D], dlat [T, D]."""
    q, lat, idx = _padded(q_SnD), _padded(lat_TD), _c(idx_SK, torch.int64)
    out, lse, dout = _padded(out_Snc), _c(lse_Sn), _padded(dout_Snc)
    S, n, D = q.shape
    dq = torch.empty(S, n, D, dtype=torch.float32)
    dlat = torch.zeros(lat.shape, dtype=torch.float32)
    _need().glm5_sparse_latent_bwd(_ptr(q), _ptr(lat), _ptr(idx), _ptr(out), _ptr(lse), _ptr(dout), S, n, D,
                                   idx.shape[1], lat.shape[0], scale, out.shape[-1], _ptr(dq), _ptr(dlat),
                                   torch.get_num_threads())
    d = q_SnD.shape[-1]
    return dq[..., :d], dlat[:, :d]


def sparse_latent_target(q_RnD: torch.Tensor, lat_TD: torch.Tensor, idx_RK: torch.Tensor, scale: float) -> torch.Tensor:
    """The sparse stage's attention target before the TP sum and the L1 norm: Σ_h softmax(scale·q_h·lat_j)
    over each row's selected latent rows j (0 where idx < 0). q [R, n, D], lat [T, D] → fp32 [R, K]."""
    q, lat, idx = _padded(q_RnD), _padded(lat_TD), _c(idx_RK, torch.int64)
    R, n, D = q.shape
    out = torch.empty(R, idx.shape[1], dtype=torch.float32)
    _need().glm5_sparse_latent_target(_ptr(q), _ptr(lat), _ptr(idx), R, n, D, idx.shape[1], scale, _ptr(out),
                                      torch.get_num_threads())
    return out


def _kl_inputs(q_RnD, w_Rn, k_TD, idx_RK, t_RK):
    return _padded(q_RnD), _c(w_Rn), _padded(k_TD), _c(idx_RK, torch.int64), _c(t_RK)


def indexer_kl(q_RnD: torch.Tensor, w_Rn: torch.Tensor, k_TD: torch.Tensor, idx_RK: torch.Tensor,
               t_RK: torch.Tensor) -> torch.Tensor:
    """Per query row, KL(t || softmax over the selected keys of I), I_j = Σ_h w_h·ReLU(q_h·k_idx[j]) (Megatron-Core's
    ``indexer_kl_sum`` terms, rows that select nothing 0). q [R, nI, dI], w [R, nI], k [T, dI], idx / t [R, K]
    → fp32 [R]."""
    q, w, k, idx, t = _kl_inputs(q_RnD, w_Rn, k_TD, idx_RK, t_RK)
    R, nI, dI = q.shape
    kl = torch.empty(R, dtype=torch.float32)
    null = ctypes.c_void_p(0)
    _need().glm5_indexer_kl(_ptr(q), _ptr(w), _ptr(k), _ptr(idx), _ptr(t), R, nI, dI, idx.shape[1], k.shape[0], 1.0,
                            _ptr(kl), null, null, null, torch.get_num_threads())
    return kl


def indexer_kl_grad(q_RnD, w_Rn, k_TD, idx_RK, t_RK, g: float):
    """Gradients of ``g`` × Σ_rows ``indexer_kl``: dq [R, nI, dI], dw [R, nI], dk [T, dI], fp32."""
    q, w, k, idx, t = _kl_inputs(q_RnD, w_Rn, k_TD, idx_RK, t_RK)
    R, nI, dI = q.shape
    dq = torch.empty(R, nI, dI, dtype=torch.float32)
    dw = torch.empty(R, nI, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    _need().glm5_indexer_kl(_ptr(q), _ptr(w), _ptr(k), _ptr(idx), _ptr(t), R, nI, dI, idx.shape[1], k.shape[0], g,
                            ctypes.c_void_p(0), _ptr(dq), _ptr(dw), _ptr(dk), torch.get_num_threads())
    d = q_RnD.shape[-1]
    return dq[..., :d], dw, dk[:, :d]
