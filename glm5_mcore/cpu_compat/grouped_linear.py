"""Transformer Engine's grouped expert linear in PyTorch, for Megatron-Core's ``TEGroupedMLP`` without TE (a part of
``glm5_mcore.cpu_compat``: ``LocalBackend.grouped_mlp_modules`` builds it)."""

from __future__ import annotations

import functools

import torch


class GroupedLinear(torch.nn.Module):
    """Transformer Engine's ``GroupedLinear`` as Megatron-Core's ``TEGroupedMLP`` uses it, in PyTorch: ``num_gemms``
    local experts as parameters ``weight0 .. weight{n-1}`` ([out/etp, in] column-, [out, in/etp] row-parallel);
    ``forward(x [T, in], m_splits) -> ([T, out], None)``, rows ``m_splits[i]`` through ``weight{i}``.

    Answers: mcore 0.19.2 defines ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` only with TE
    (extensions/transformer_engine.py:2104-2718) and ``LocalSpecProvider`` ignores ``moe_use_grouped_gemm``
    (models/backends.py:133-142): without TE no grouped expert layout exists. With this one ``TEGroupedMLP``
    itself (forward, ``sharded_state_dict``) runs on the CPU. The GEMMs run per expert: the CPU ``grouped_mm``
    of torch 2.13 has no working backward ("Invalid strides/sizes"). Parameter attributes and the checkpoint
    layout are TE's (transformer_engine.py:91-123, 2508-2610): ``SequentialMLP``'s keys on the global expert axis.
    """

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: str, config,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool = True, pg_collection=None, **_):
        super().__init__()
        from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection

        if bias or not is_expert:
            raise ValueError("cpu_compat.GroupedLinear: routed experts without bias only (as GLM-5's)")
        self.config, self.num_gemms, self.parallel_mode = config, num_gemms, parallel_mode
        self._pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        tp = self._pg.expt_tp.size()
        output_size, input_size = (output_size // tp, input_size) if parallel_mode == "column" else \
            (output_size, input_size // tp)
        self.in_features, self.out_features = input_size, output_size
        expert_groups = config.expert_model_parallel_size > 1 or \
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:
                init_method(w.data)
            w.allreduce, w.tensor_model_parallel = not expert_groups, True
            w.partition_dim, w.partition_stride = int(parallel_mode == "row"), 1
            self.register_parameter(f"weight{i}", w)
        self._register_load_state_dict_pre_hook(self._drop_split_extra_states)

    def forward(self, x: torch.Tensor, m_splits: list[int]):
        ws = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        outs = [torch.nn.functional.linear(xi, w) for xi, w in zip(torch.split(x, list(m_splits)), ws)]
        return (torch.cat(outs) if outs else x.new_zeros(0, self.out_features)), None

    def backward_dw(self) -> None:
        """``TEGroupedMLP.backward_dw`` calls it; weight gradients are never delayed here."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass

    def _drop_split_extra_states(self, state_dict, prefix, *args) -> None:
        for i in range(1, self.num_gemms):  # the per-expert objects of the sharded checkpoint
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """``{prefix}weight{i}`` at global expert ``ep_rank * n + i`` on a new leading axis, TP-sharded on dim 0
        (column) or 1 (row), one replica per expert-DP group (TE's rule)."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError("cpu_compat.GroupedLinear: singleton_local_shards is not supported")
        ep, edp = self._pg.ep, self._pg.expt_dp
        n_global, first, out = ep.size() * self.num_gemms, ep.rank() * self.num_gemms, {}
        for i in range(self.num_gemms):
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": getattr(self, f"weight{i}"), f"{i}._extra_state": None}, "",
                {f"{i}.weight": int(self.parallel_mode == "row")},
                (*sharded_offsets, (len(sharded_offsets), first + i, n_global)),
                tp_group=self._pg.expt_tp, dp_cp_group=(metadata or {}).get("dp_cp_group") or edp)
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{i or ''}"] = sub[f"{i}._extra_state"]
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], edp.rank())
        return out


# TEGroupedMLP's linear_fc1 / linear_fc2 builders (called as moe/experts.py:214-250 calls them)
ColumnParallelGroupedLinear = functools.partial(GroupedLinear, parallel_mode="column")
RowParallelGroupedLinear = functools.partial(GroupedLinear, parallel_mode="row")
