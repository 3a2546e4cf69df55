"""The colocated trainer's offload of its frozen base (``rl.train.offload.TrainerOffload``, ``rollout.colocate.
offload_weights``) with TE FP8 weights (stand-ins with TE v2.14's storage rules, ``tests/support/te_stand_in.py``):
what each parameter stores is looked up at every offload, so a column-wise copy made (as new tensors) between steps
is neither kept on the device nor brought back, and no dead copy stays in the host copy."""

from types import SimpleNamespace

import torch

from glm5_mcore.device import HOST_ALIGN
from glm5_mcore.model.fp8_linear import stored_tensors
from rl.train.offload import TrainerOffload
from tests.support.te_stand_in import FakeTELinear


def _ddp():
    noop = lambda **_: None  # noqa: E731 - no gradient buffers in this model
    return SimpleNamespace(buffers=[], expert_parallel_buffers=[], offload_grad_buffers=noop, restore_grad_buffers=noop)


def test_offload_follows_what_a_te_fp8_weight_stores_each_step():
    model = torch.nn.Sequential(FakeTELinear(256, 384), FakeTELinear(128, 256))  # built with grad: column-wise on
    weights = [lin.weight for lin in model]
    off = TrainerOffload(_ddp(), None, model, weights=True)
    arenas = []
    for step in range(3):
        for w in weights:  # a pass between steps made the column-wise copy again: new tensors
            w._create_columnwise()
        rowwise = [(w._rowwise_data.clone(), w._rowwise_scale_inv.clone()) for w in weights]
        off.offload()
        held = {id(t) for w in weights for t in stored_tensors(w)}
        dead = [tuple(t.shape) for t in off.weights.tensors if id(t) not in held]
        assert not dead, f"step {step}: the host copy holds {len(dead)} tensor(s) no parameter references: {dead}"
        on_device = [tuple(t.shape) for w in weights for t in stored_tensors(w) if t.untyped_storage().nbytes()]
        assert not on_device, f"step {step}: still on the device after the offload: {on_device}"
        arenas.append(off.weights.arena.data_ptr())
        off.restore()
        for w, (d, s) in zip(weights, rowwise):
            assert torch.equal(w._rowwise_data, d) and torch.equal(w._rowwise_scale_inv, s)
            assert w._columnwise_data is None  # TE makes it again in the next backward
    # the row-wise data and scales only, each at a page-aligned offset; one arena, reused every step
    assert off.weights.host_bytes == sum(-(-n // HOST_ALIGN) * HOST_ALIGN for d, s in rowwise
                                         for n in (d.numel(), 4 * s.numel()))
    assert len(set(arenas)) == 1
