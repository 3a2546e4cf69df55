"""What both converters (``convert.hf_to_mcore``, ``convert.mcore_to_hf``) share: the GLM-5 ``GPTModel`` on
the meta device at TP1/EP1 that describes the Megatron side (``meta_model``: its ``sharded_state_dict()`` is
exactly what Megatron-Core's own save would write), its named tensors, the dtype a distributed
checkpoint stores, the progress bar, and the failure path both share (``verified_run``).

The design of ``glm5 convert`` (both directions stream, every check before anything is written, the output
built under a temporary name) is in ``glm5_mcore.convert.hf_to_mcore``'s docstring.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from glm5_mcore.checkpoint.megatron_lm import dcp_metadata
from glm5_mcore.checkpoint.manifest import StreamVerifier
from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.model.build import build_model
from glm5_mcore.model.parallel import init_parallel



@contextmanager
def verified_run(checks: StreamVerifier, bar: "Progress"):
    """The body of a conversion: on a failure the checks of the bytes read so far decide first (a corrupt
    input file explains a failure better than what it caused, and is named), and the bar closes either way.
    The body itself calls ``checks.result()`` before its output is published."""
    try:
        yield
    except BaseException:
        checks.result()
        raise
    finally:
        bar.close()


class Progress:
    """tqdm over bytes with a tensor count; thread-safe; silent when ``enabled`` is False."""

    def __init__(self, total_bytes: int, n_tensors: int, desc: str, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not enabled,
                        dynamic_ncols=True)
        self.n, self.total, self.lock = 0, n_tensors, threading.Lock()

    def update(self, nbytes: int) -> None:
        with self.lock:
            self.n += 1
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.n}/{self.total} tensors", refresh=False)

    def close(self) -> None:
        self.bar.close()


def meta_model(glm5: GLM5Config, dtype: torch.dtype):
    """The TP1/EP1 GLM-5 ``GPTModel`` on the meta device (shapes, names and sharding only)."""
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.transformer.experimental_attention_variant.dsa  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    import glm5_mcore.model.layer_spec  # noqa: F401

    # Everything is imported above: a module imported inside the meta context would create its
    # module-level tensors (e.g. MTPLossAutoScaler.main_loss_backward_scale) on the meta device.
    init_parallel(ParallelConfig())
    with torch.device("meta"):
        return build_model(glm5, ParallelConfig(), params_dtype=dtype, use_cpu_initialization=True,
                           perform_initialization=False, device="meta")


def named_tensors(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(t) and not n.endswith("_extra_state")}


def checkpoint_dtype(model_path: Path) -> torch.dtype:
    for key, m in dcp_metadata(model_path).items():
        if key.endswith("word_embeddings.weight"):
            return m.properties.dtype
    raise ValueError(f"{model_path}: no embedding tensor in the checkpoint")
