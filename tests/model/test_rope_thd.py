"""``cpu_compat``'s one-pass RoPE of packed (THD) sequences equals Megatron-Core's unfused one, which applies it
one sequence at a time (rope_utils.py:252-268), bit for bit: under CP 1 / 2 / 4 (each rank's zigzag halves),
rotary and MLA interleaving, mscale, head dims that do and do not fill a SIMD vector, empty documents; and it
reads nothing back from the device."""

import itertools

import torch

from glm5_mcore import cpu_compat
from glm5_mcore.probes.fake_device import fake_device, host
from glm5_mcore.probes.host_reads import count_host_reads


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _thd():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    cpu_compat.apply()
    ours = rope_utils._apply_rotary_pos_emb_thd
    assert rotary_pos_embedding._apply_rotary_pos_emb_thd is ours and ours.__wrapped__ is not ours
    return ours, ours.__wrapped__


def test_one_pass_thd_rope_equals_megatrons_per_sequence_loop_bitwise():
    ours, megatron = _thd()
    g = torch.Generator().manual_seed(0)
    cases = 0
    for cp, d, rotary_il, mla_il, mscale in itertools.product([1, 2, 4], [8, 12, 64], [False, True], [False, True],
                                                            [1.0, 1.3]):
        # multiples of 2 x cp, as the CP split pads them; empty ones only without rotary interleaving, which
        # Megatron-Core's per-sequence loop cannot reshape (rope_utils.py:89)
        docs = torch.randint(int(rotary_il), 40, (17,), generator=g) * 2 * cp
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), docs.cumsum(0).int()])
        freqs = torch.rand(int(docs.max()) + 5, 1, 1, d, generator=g) * 50  # [max_s, 1, 1, d]
        t = torch.randn(int(cu[-1]) // cp, 3, d + 4, generator=g)          # [T, h, d + a pass-through part]
        for rank in range(cp):
            kw = dict(rotary_interleaved=rotary_il, mla_rotary_interleaved=mla_il, mscale=mscale,
                      cp_group=_Group(cp, rank))
            want = megatron(t, cu, freqs, **kw)
            assert torch.equal(ours(t, cu, freqs, **kw), want), (cp, d, rotary_il, mla_il, mscale, rank)
            cases += 1
    assert cases == 3 * 2 * 2 * 2 * (1 + 2 + 4)  # head dims x interleavings x mscales, on every CP rank
    # freqs given per packed token (rope_utils.py:232-250) stays Megatron-Core's own path
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    t, freqs = torch.randn(12, 2, 8, generator=g), torch.randn(12, 1, 1, 8, generator=g)
    assert torch.equal(ours(t, cu, freqs, cp_group=_Group(1, 0)), megatron(t, cu, freqs, cp_group=_Group(1, 0)))


def test_one_pass_thd_rope_reads_nothing_back_from_the_device():
    ours, megatron = _thd()
    cu = torch.tensor([0, 8, 8, 32, 40], dtype=torch.int32)
    t, freqs = torch.randn(20, 2, 8), torch.randn(30, 1, 1, 8)  # max_s rows, not one per packed token
    want = megatron(t, cu, freqs, cp_group=_Group(2, 1))
    with fake_device() as dev:
        args = (t.to(dev), cu.to(dev), freqs.to(dev))
        with count_host_reads() as reads:
            got = ours(*args, cp_group=_Group(2, 1))
        with count_host_reads() as theirs:
            megatron(*args, cp_group=_Group(2, 1))
    assert torch.equal(host(got), want)
    assert reads.reads == [], reads.reads
    assert theirs.reads  # rope_utils.py:225-227: the per-sequence split reads the lengths back
