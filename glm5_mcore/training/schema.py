"""The config sections both recipes share, and typed configs from plain dicts (OmegaConf structured configs).

Sections defined once and used by SFT (``recipes.sft_config.SFTConfig``) and RL (``rl.config.RLConfig``):

- ``ModelCfg`` (``model``): which weights; ``LoRACfg`` (``lora``, and RL's ``critic.lora``): the adapter.
- ``ParallelConfig`` (SFT ``parallel``; ``glm5_mcore.config``), ``OptimCfg`` (SFT ``optim``) and ``WandbCfg``
  (``wandb``; ``glm5_mcore.training.loop``), ``PlanCfg`` (``plan``; ``glm5_mcore.plan.job``): defined beside the
  code that reads them, re-exported here.

``build(schema, d)`` turns a plain dict (a resolved Hydra config, or a test's dict) into the dataclass
``schema`` with OmegaConf: unknown keys, wrong types and ``???`` (missing) values are a ``ConfigError`` of one
line naming the key (``config: train.steps must be a number, got 'abc'``). Switches and numbers must be
given as such: OmegaConf's string conversions (``"yes"`` -> true, ``"3"`` -> 3) are refused here, as before.
Hydra stays at the entry point (``recipes.hydra_app``); this module only needs OmegaConf.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.lora.config import DEFAULT_TARGETS, LoRAConfig
from glm5_mcore.plan.job import PlanCfg
from glm5_mcore.training.loop import OptimCfg, WandbCfg

__all__ = ["ModelCfg", "LoRACfg", "ParallelConfig", "OptimCfg", "WandbCfg", "PlanCfg", "ConfigError", "build",
           "field_docs", "describe_fields", "error_message"]


@dataclass
class ModelCfg:
    hf_dir: Optional[str] = None
    """HF folder: config.json, tokenizer, and the base weights unless ``ckpt`` is given."""
    ckpt: Optional[str] = None
    """glm5-mcore checkpoint folder with the base weights (latest iteration; ``glm5 convert hf-to-mcore``, an SFT
    run), or a Megatron-LM / Megatron-Bridge checkpoint folder."""
    mtp: str = "auto"
    """SFT: "auto": the MTP layers the weights store (a transformers-saved folder has none: no MTP block, no MTP
    loss); "init": the ``num_nextn_predict_layers`` config.json declares, those the weights lack initialised as
    Megatron-Core initialises them, and trained; "off": no MTP block. RL: "auto" only (the MTP block is built
    for ``actor.mtp_loss_scale > 0`` or ``actor.mtp_accept``)."""
    base_dtype: Optional[str] = None
    """The frozen base's storage: null = the trainer's parameter dtype (bf16 / fp32); "fp8" (LoRA only) = the
    checkpoint's e4m3 weights and block scales as stored (``weight_scale_inv``), no dequantize-requantize, for
    the linears the release stores in FP8, from ``hf_dir`` or a ``ckpt`` converted from it (``glm5 convert
    hf-to-mcore`` keeps them FP8); a bf16 folder or checkpoint is quantized once with the release's scheme;
    1 byte per parameter instead of 2. The local spec computes with a reference GEMM (exact in fp32), TE with
    its blockwise FP8 recipe. See ``glm5_mcore/model/fp8_linear.py``."""
    dsa_kernel_backend: str = "auto"
    """DSA's fused kernels (Megatron-Core's ``dsa_kernel_backend``): "auto" = "tilelang" on CUDA where the model
    meets the kernels' constraints, else "none" (said once at start-up); "none" = this project's kernels (fused C++ on the CPU, the sync-free PyTorch path elsewhere); "tilelang"
    or "cudnn" (CUDA only; bf16, index_topk % 64 == 0, heads per TP rank a power of two). See docs/dsa.md."""
    moe_grouped_gemm: Optional[bool] = None
    """Megatron-Core's ``moe_grouped_gemm``: the routed experts as ``TEGroupedMLP`` (all local experts in one
    grouped GEMM) instead of ``SequentialMLP``. None: on for the TE spec (``trainer.backend=te``), off for the
    local spec. Checkpoints are the same either way; LoRA on the routed experts (``experts.linear_fc1/2``)
    needs it off. See docs/gpu.md."""


@dataclass
class LoRACfg:
    enabled: bool = True
    """False: full fine-tuning (SFT only; RL trains adapters)."""
    name: str = "default"
    """The adapter's name in the checkpoint (``iter_N/adapters/{name}``); RL's policy adapter is "default"."""
    rank: int = 16
    alpha: float = 32.0
    """Scale alpha / rank on the adapter's output."""
    dropout: float = 0.0
    """Dropout on the adapter's input (SFT only: RL log-probs must be deterministic)."""
    targets: list = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear families that get adapters: ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
    ``linear_kv_up_proj``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` (dense + shared expert),
    ``experts.linear_fc1``, ``experts.linear_fc2``, and the DSA indexer's ``linear_wq_b``, ``linear_wk``,
    ``linear_weights_proj``."""

    def to_lora_config(self, seed: int) -> LoRAConfig:
        """The ``LoRAConfig`` this section describes, its adapters initialised from ``seed`` (the one place a
        recipe's section becomes the library's config: what ``apply_lora`` attaches and what the checkpoint's
        ``adapter_config.json`` records)."""
        return LoRAConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=tuple(self.targets),
                          seed=seed)


class ConfigError(ValueError):
    """A config value is refused; the message is one line naming the key."""


def _unoptional(t):
    args = typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else Any
    return t


@functools.lru_cache(maxsize=None)
def _hints(schema) -> dict:
    return {f.name: _unoptional(t) for f, t in zip(dataclasses.fields(schema),
                                                  (typing.get_type_hints(schema)[f.name]
                                                   for f in dataclasses.fields(schema)))}


def _field_type(schema, key: str):
    """The (non-Optional) type of dotted ``key`` in ``schema``, or None."""
    t = schema
    for part in key.split("."):
        if not (isinstance(t, type) and dataclasses.is_dataclass(t)) or part not in _hints(t):
            return None
        t = _hints(t)[part]
    return t


def _kind_error(key: str, t, v) -> str | None:
    """``key must be ...`` when ``v`` is not a ``t`` switch / number (None: fine or not such a field)."""
    if v is None:
        return None
    if t in (list, dict) and not isinstance(v, (list, tuple) if t is list else dict):
        return f"config: {key} must be a {'list' if t is list else 'mapping'}, got {v!r}"
    if t is bool and not isinstance(v, bool):
        return f"config: {key} must be true or false, got {v!r}"
    if t in (int, float):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"config: {key} must be a number, got {v!r}"
        if t is int and not float(v).is_integer():
            return f"config: {key} must be an integer, got {v!r}"
    return None


def _strict(schema, d: dict, path: str) -> dict:
    """``d`` with integral floats of int fields as ints; refuses what OmegaConf would convert from a string."""
    out = {}
    for k, v in d.items():
        key = f"{path}{k}"
        t = _hints(schema).get(k) if isinstance(k, str) else None
        if t is None:  # a schema's ``foreign_names``: another framework's name for one of its fields
            hint = getattr(schema, "foreign_names", {}).get(k) if isinstance(k, str) else None
            raise ConfigError(f"config: unknown field {key}" + (f" ({hint})" if hint else ""))
        if isinstance(v, str) and v == "???":
            raise ConfigError(f"config: {key} is missing (???): give it, e.g. {key}=...")
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            if v is not None and not isinstance(v, dict):
                raise ConfigError(f"config: {key} must be a mapping, got {v!r}")
            out[k] = _strict(t, v, f"{key}.") if v else v
            continue
        msg = _kind_error(key, t, v)
        if msg:
            raise ConfigError(msg)
        out[k] = int(v) if t is int and isinstance(v, float) else v
    return out


def error_message(schema, e: Exception) -> str:
    """One line naming the key for an OmegaConf error raised while filling ``schema``."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue

    key = getattr(e, "full_key", None) or getattr(e, "key", None) or ""
    if isinstance(e, MissingMandatoryValue):
        return f"config: {key} is missing (???): give it, e.g. {key}=..."
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and " not in " in str(e):
        return f"config: unknown field {key}"
    t = _field_type(schema, str(key)) if key else None
    value = getattr(e, "value", None)
    msg = _kind_error(key, t, value) if t is not None else None
    if msg:
        return msg
    text = str(getattr(e, "msg", None) or e).splitlines()[0] if str(e) else type(e).__name__
    return f"config: {key}: {text}" if key else f"config: {text}"


def build(schema, d: Optional[dict]):
    """The ``schema`` dataclass filled from the plain dict ``d`` (OmegaConf structured merge); ConfigError
    naming the key for an unknown key, a wrong type or a missing (``???``) value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    d = _strict(schema, dict(d or {}), "")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), d))
    except OmegaConfBaseException as e:
        raise ConfigError(error_message(schema, e)) from None


# --------------------------------------------------------------------------------------------------
# field docs (the docstring under each field), for ``glm5 sft --help`` / ``glm5 rl --help``
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def field_docs(schema) -> dict:
    """{field: the string literal under it in the class body} (Python keeps no attribute docstrings)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = inspect.cleandoc(b.value.value)
    return docs


def _type_name(t) -> str:
    t0 = _unoptional(t)
    name = getattr(t0, "__name__", None) or str(t0).replace("typing.", "")
    return name + (" | None" if t0 is not t else "")


def describe_fields(schema, prefix: str = "", width: int = 100) -> list[str]:
    """``section.field: type = default`` lines, each with its doc indented below, for every field of the
    dataclass ``schema`` (a class: its defaults; an instance: its values)."""
    obj = schema() if isinstance(schema, type) else schema
    cls = type(obj)
    lines = []
    if prefix and cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        lines += textwrap.wrap(f"[{prefix[:-1]}] " + " ".join(cls.__doc__.split()), width,
                               initial_indent="  ", subsequent_indent="      ")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            lines += describe_fields(value, f"{prefix}{f.name}.", width)
            continue
        lines.append(f"  {prefix}{f.name}: {_type_name(hints[f.name])} = {value!r}")
        if f.name in docs:
            lines += textwrap.wrap(" ".join(docs[f.name].split()), width, initial_indent="      ",
                                   subsequent_indent="      ")
    return lines
