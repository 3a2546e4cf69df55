"""``model.dsa_kernel_backend`` chosen as a Megatron-Core user expects (issue 39 G1, G2, G13), with the fused
packages faked importable on the CPU: ``auto`` is the fused path only where the model meets its constraints
(the PyTorch path otherwise, said once), an explicit backend keeps its one-line refusal, a TileLang whose native
libraries fail to load (OSError) is a missing package, and cuDNN is judged by its own requirements."""

import importlib.abc
import importlib.machinery
import sys
import types
import warnings

import pytest
import torch


def _configs(model, **kw):
    """``make_config`` for ``dsa_backend.select``: Megatron-Core's config with the backend set after its
    validation (which needs CUDA for a fused backend), as ``bench/gpu_check_dsa.py`` builds it on a CPU."""
    from glm5_mcore.mcore_settings import ParallelConfig

    made = []

    def make(backend):
        cfg = model.to_mcore_config(ParallelConfig(), dsa_kernel_backend="none", **kw)
        cfg.dsa_kernel_backend = backend
        made.append(backend)
        return cfg

    return make, made


def test_auto_takes_the_pytorch_path_for_a_model_outside_the_fused_kernels(monkeypatch):
    """G1: TileLang importable and the device CUDA: a tiny fp32 model gets ``none`` with one warning naming
    why (once per process), GLM-5's widths in bf16 get ``tilelang``; an explicit ``tilelang`` on the tiny
    model is still refused in one line."""
    from glm5_mcore.config import glm5_744b, glm5_tiny
    from glm5_mcore.model import dsa_backend

    monkeypatch.setattr(dsa_backend, "missing_packages", lambda backend: [])
    monkeypatch.setattr(dsa_backend, "_noticed", set())
    assert dsa_backend.resolve("auto", "cuda") == "tilelang"  # what the model alone cannot veto
    make, made = _configs(glm5_tiny())
    with pytest.warns(UserWarning, match=r"dsa_kernel_backend=auto: the PyTorch DSA path, not tilelang: "
                                         r"weights are float32.*index_topk 8 is not a multiple of 64"):
        cfg = dsa_backend.select("auto", "cuda", make, tp=1)
    assert cfg.dsa_kernel_backend == "none" and not dsa_backend.active(cfg)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert dsa_backend.select("auto", "cuda", make, tp=1).dsa_kernel_backend == "none"
    assert not [w for w in again if "dsa_kernel_backend" in str(w.message)]  # said once
    big, made_big = _configs(glm5_744b(), bf16=True, params_dtype=torch.bfloat16)
    for tp in (1, 8):
        assert dsa_backend.select("auto", "cuda", big, tp=tp).dsa_kernel_backend == "tilelang"
    assert made_big[-2:] == ["none", "tilelang"]  # judged on the none config, rebuilt fused (Megatron validates)
    explicit = dsa_backend.select("tilelang", "cuda", make, tp=1)
    with pytest.raises(ValueError) as e:
        dsa_backend.check(explicit, tp=1)
    assert str(e.value).startswith("model.dsa_kernel_backend=tilelang: weights are float32") and "\n" not in str(e.value)


class _Faked(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules made on import: ``name -> attrs`` (a dict) or an exception raised while loading it."""

    def __init__(self, mods):
        self.mods = mods

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in self.mods else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        what = self.mods[module.__name__]
        if isinstance(what, BaseException):
            raise what
        vars(module).update(what)


@pytest.fixture
def faked(monkeypatch):
    def install(mods):
        for name in mods:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [_Faked(mods), *sys.meta_path])

    return install


def test_a_tilelang_whose_native_library_fails_to_load_is_missing(faked):
    """G2: TileLang's import raising OSError (``ctypes.CDLL`` of a missing library) is a missing package:
    ``auto`` on CUDA warns and runs the PyTorch path, an explicit ``tilelang`` is one line."""
    from glm5_mcore.model import dsa_backend

    faked({"tilelang": OSError("libz3.so: cannot open shared object file: No such file or directory")})
    assert dsa_backend.missing_packages("tilelang") == ["tilelang"]
    with pytest.warns(UserWarning, match="TileLang is not installed"):
        assert dsa_backend.resolve("auto", "cuda") == "none"
    with pytest.raises(ValueError, match=r"^model.dsa_kernel_backend=tilelang: missing tilelang"):
        dsa_backend.resolve("tilelang", "cuda")


def test_cudnn_is_judged_by_its_own_requirements(faked):
    """G13: ``cudnn`` needs ``from cudnn import DSA`` (Megatron-Core's check), not ``import cudnn``; TileLang's
    head and top-k rules are not cuDNN's (Megatron-Core's cuDNN hooks decline what they cannot run)."""
    from types import SimpleNamespace

    from glm5_mcore.model import dsa_backend

    faked({"flash_mla": {"flash_mla_sparse_fwd": object()}, "cudnn": {}})  # a cudnn-frontend without DSA
    assert dsa_backend.missing_packages("cudnn") == ["cudnn.DSA"]
    with pytest.raises(ValueError, match="missing cudnn.DSA"):
        dsa_backend.resolve("cudnn", "cuda")
    odd = SimpleNamespace(dsa_kernel_backend="cudnn", num_attention_heads=48, params_dtype=torch.bfloat16,
                          dsa_indexer_topk=1000, kv_lora_rank=512, qk_pos_emb_head_dim=64, dsa_indexer_n_heads=12)
    assert dsa_backend.problems(odd, tp=1, trains_indexer=True, package_check=False) == []
    assert len(dsa_backend.problems(odd, tp=1, trains_indexer=True, package_check=False, backend="tilelang")) == 3
    fp32 = SimpleNamespace(**{**vars(odd), "params_dtype": torch.float32, "kv_lora_rank": 256})
    assert len(dsa_backend.problems(fp32, tp=1, package_check=False)) == 2
