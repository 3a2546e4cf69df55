"""With the FP8 base on Transformer Engine (``model.base_dtype=fp8``, ``trainer.backend=te``) every FP8 ``Linear``
asserts that its per-rank input is a multiple of 8 tokens; the packers pad for it through one rule
(``mcore_settings.token_multiple``: 16 per TP shard, Megatron-Bridge's 16·TP·2·CP under CP). Checked on the
16 x H100 preset's layout (TP 8, CP 2, sequence parallel) for the RL trainer's packer and the SFT stream, with
samples of odd lengths, on every CP rank."""

import random
from types import SimpleNamespace

import torch

from glm5_mcore.config import glm5_744b
from glm5_mcore.mcore_settings import ParallelConfig, token_multiple
from glm5_mcore.model.fp8_te import te_fp8_overrides
from tests.support.te_stand_in import te_version

TP, CP = 8, 2


def _preset_config(fp8: bool):
    """The Megatron-Core config the trainer builds at the preset's layout (TE spec; FP8 base or not)."""
    with te_version():
        return glm5_744b().to_mcore_config(ParallelConfig(tp=TP, ep=16, cp=CP), transformer_impl="transformer_engine",
                                           bf16=True, params_dtype=torch.bfloat16,
                                           **(te_fp8_overrides() if fp8 else {}))


def _lengths(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(3, 61), rng.randint(1, 97)) for _ in range(n)]  # (prompt, response), odd sums included


def _rl_shard_tokens(multiple: int) -> list[int]:
    from rl.train.batch import RolloutBatch
    from rl.train.cp import RLContextParallel
    from rl.train.micro_batch import pack_micro_batches

    pr = _lengths(24, 0)
    batch = RolloutBatch.build([[5] * p for p, _ in pr], [[7] * r for _, r in pr], [[-1.0] * r for _, r in pr],
                               list(range(len(pr))))
    out = []
    for rank in range(CP):
        cp = RLContextParallel(multiple, size=CP, rank=rank)
        for mb in pack_micro_batches(batch, list(range(batch.size)), 1024, 0, cp, multiple):
            assert mb.num_tokens % TP == 0
            out.append(mb.num_tokens // TP)
    return out


def _sft_shard_tokens(multiple: int) -> list[int]:
    from glm5_mcore.data.sft import Document
    from glm5_mcore.data.stream import SFTStream

    docs = [Document([3] * (p + r + 1), [0] * p + [1] * (r + 1)) for p, r in _lengths(40, 1)]
    out = []
    for rank in range(CP):
        data = SimpleNamespace(micro_batch_tokens=512, seed=0)
        stream = SFTStream(data, SimpleNamespace(train=docs, valid=None), {"epoch": 0, "cursor": 0}, steps=1,
                           accum=4, dp=1, dp_rank=0, cp=CP, cp_rank=rank, multiple=multiple, pad_id=0,
                           equal_sizes=False, pipeline=False, cache_dir="unused")
        for b in stream.step({"epoch": 0, "cursor": 0})[0]:
            assert b.input_ids.shape[1] % TP == 0
            out.append(b.input_ids.shape[1] // TP)
    return out


def test_fp8_te_micro_batches_hold_16_tokens_a_tp_shard_on_every_cp_rank():
    fp8 = _preset_config(fp8=True)
    assert fp8.fp8 == "e4m3" and fp8.sequence_parallel and fp8.context_parallel_size == CP
    multiple = token_multiple(fp8)
    assert multiple == 16 * TP
    rl, sft = _rl_shard_tokens(multiple), _sft_shard_tokens(multiple)
    print("per TP shard, RL:", rl, "SFT:", sft)
    assert rl and sft and all(n % 16 == 0 for n in rl + sft), (rl, sft)
    # bf16 on TE, or the local spec's FP8 base: the sequence-parallel split only (each shard a multiple of 2 at CP 2)
    assert token_multiple(_preset_config(fp8=False)) == TP
