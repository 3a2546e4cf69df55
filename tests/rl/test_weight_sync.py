"""``rl.rollout.weight_sync``: buckets of whole vLLM modules in push order, bit-exact pack/unpack for every dtype,
and the handle protocol with the CPU stand-in (the CUDA-IPC codec runs in ``bench/gpu_check_colocate.py``;
the cross-process round trip into vLLM in ``tests/rl/test_vllm_cpu.py::test_colocated_vllm_matches_separate``)."""

import os

import pytest
import torch

from rl.rollout import weight_sync as ws


def _layer(i: int, experts: int = 4) -> dict:
    g = torch.Generator().manual_seed(i)
    out = {f"model.layers.{i}.self_attn.q_a_proj.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
           f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight": torch.randn(5, 16, generator=g).to(torch.bfloat16)}
    for e in range(experts):
        for k in ("gate_proj", "up_proj", "down_proj"):
            w = torch.randn(12, 16, generator=g).to(torch.float8_e4m3fn)
            out[f"model.layers.{i}.mlp.experts.{e}.{k}.weight"] = w
            out[f"model.layers.{i}.mlp.experts.{e}.{k}.weight_scale_inv"] = torch.rand(1, 1, generator=g)
    out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.arange(experts, dtype=torch.int64)
    return out


def _group(h: str) -> str:
    from rl.rollout.vllm_weights import vllm_module_tensors

    return vllm_module_tensors(h.removesuffix("_scale_inv"), 4)[0]


def test_buckets_keep_whole_vllm_modules_in_order():
    tensors = {**_layer(0), **_layer(1)}
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    for max_bytes in (1, 700, 4096, 1 << 30):
        buckets = ws.plan_buckets(sizes, max_bytes, _group)
        flat = [n for b in buckets for n in b]
        assert sorted(flat) == sorted(tensors) and len(flat) == len(set(flat))  # every tensor once
        groups = {}
        for i, b in enumerate(buckets):
            for n in b:
                groups.setdefault(_group(n), set()).add(i)
        assert all(len(v) == 1 for v in groups.values())  # a module never split over buckets
        order = [_group(n) for n in flat]
        first = list(dict.fromkeys(order))
        assert first == list(dict.fromkeys(_group(n) for n in tensors))  # modules in push order
        for b in buckets:
            size = sum(-(-sizes[n] // ws.ALIGN) * ws.ALIGN for n in b)
            assert size <= max_bytes or len({_group(n) for n in b}) == 1
    experts = [n for n in tensors if ".experts." in n and n.startswith("model.layers.0.")]
    assert len(ws.plan_buckets(sizes, 1, _group)) == 6  # q_a+kv_a, the FusedMoE, the bias; twice
    assert any(set(experts) <= set(b) for b in ws.plan_buckets(sizes, 1, _group))


def test_pack_unpack_bit_exact_and_aligned():
    tensors = _layer(3)
    names = list(tensors)
    flat, metas = ws.pack(tensors, names)
    assert flat.dtype == torch.uint8 and all(m.offset % ws.ALIGN == 0 for m in metas)
    back = ws.unpack(flat, metas)
    assert [n for n, _ in back] == names
    for n, t in back:
        assert t.dtype == tensors[n].dtype and t.shape == tensors[n].shape
        assert torch.equal(t.view(torch.uint8), tensors[n].contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match="past the bucket"):
        ws.unpack(flat[:10], metas)


def test_send_through_the_shared_file_stand_in():
    tensors = {**_layer(0), **_layer(1)}
    codec = ws.codec("shared_file")
    got, paths = [], []

    def receive(handle, metas):  # what the vLLM worker does: map the handle, read views
        paths.append(handle[0])
        assert os.path.exists(handle[0])
        got.append([(n, t.clone()) for n, t in ws.receive(handle, metas, "shared_file")])

    sent = ws.send([tensors], 2048, codec, receive, _group)
    assert len(sent) == len(got) > 2 and [n for b in got for n, _ in b] == [n for b in sent for n in b["names"]]
    for bucket in got:
        for n, t in bucket:
            assert torch.equal(t.view(torch.uint8), tensors[n].view(torch.uint8))
    assert not any(os.path.exists(p) for p in paths)  # released after each load
    with pytest.raises(ValueError, match="CUDA device"):
        ws.codec("cuda_ipc").export(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codec 'nccl'"):
        ws.codec("nccl")


def test_send_holds_one_bucket_at_a_time():
    """G9: the sender's memory during a push is one bucket (the planner's ``SYNC_BUCKET``), not two: each bucket
    is freed before the next is packed, and nothing is left after the push (live bytes of what ``send`` made)."""
    from glm5_mcore.probes.live_bytes import LiveBytes

    class Direct(ws.Codec):  # the handle is the buffer (CUDA IPC copies nothing either; the file stand-in does)
        def export(self, flat):
            return flat

    tensors = {**_layer(0), **_layer(1), **_layer(2)}
    with LiveBytes(outside=list(tensors.values())) as live:
        sent = ws.send([tensors], 2048, Direct(), lambda h, m: None, _group)
        left = live.now
    assert len(sent) > 2
    biggest = max(b["bytes"] for b in sent)
    assert live.peak <= biggest + 512, (live.peak, biggest, live.at_peak[:3])
    assert left == 0
