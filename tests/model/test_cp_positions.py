"""G11: host reads under context parallelism with THD and in every MoE layer, counted under the stand-in device
(``glm5_mcore.probes.host_reads``, as the DSA host-read test does): this project's packed CP positions equal
Megatron-Core's and read nothing back (Megatron-Core's boolean filters sync every DSA layer), and ``MoELoad``'s
real-token count in a MoE layer's router hook reads nothing back."""

import pytest
import torch

from glm5_mcore.probes.fake_device import fake_device, host
from glm5_mcore.probes.host_reads import count_host_reads

LAYOUTS = [[8, 16, 0, 24], [4], [12, 4, 8], [0, 8, 8, 0]]


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_cp_positions_equal_megatrons_without_host_reads(cp):
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    from glm5_mcore.model.cp_positions import packed_cp_positions

    for docs in LAYOUTS:
        docs = [d * cp for d in docs]  # each a multiple of 2 x cp, as the THD CP split pads them
        cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int64)
        rows = sum(docs) // cp + 3  # three rows of padding past the documents
        for rank in range(cp):
            want = dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(
                cu, cu, cp, rank, torch.device("cpu"), local_output_size=rows)
            got = packed_cp_positions(cu, cu, cp, rank, rows)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (docs, rank)
            with fake_device() as dev:
                d = cu.to(dev)
                with count_host_reads() as ours:
                    q, reorder = packed_cp_positions(d, d, cp, rank, rows)
                with count_host_reads() as theirs:
                    dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(d, d, cp, rank, dev,
                                                                                         local_output_size=rows)
                assert torch.equal(host(q), want[0]) and torch.equal(host(reorder), want[1])
            assert ours.reads == [], ours.reads
            assert theirs.reads  # what the layer called before: dsa_layout.py:248-251, 274-277
    with pytest.raises(ValueError, match="not a multiple of 2 x cp"):
        packed_cp_positions(torch.tensor([0, 6]), torch.tensor([0, 6]), 4, 0, 2)


def test_moe_layer_counts_real_tokens_without_host_reads(tiny_dir, single_rank):
    """A tiny model's MoE layer (router, experts) forward under the stand-in device with ``MoELoad`` counting only
    real tokens (the RL trainer's ``token_mask``): no host read from the count (loop.py), and the counts equal
    the boolean-index count over the same routing."""
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.training.loop import MoELoad

    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    with fake_device() as dev:
        m = build_model(glm5, ParallelConfig())
        load_hf_weights(m, tiny_dir, glm5)
        layer = next(x for x in m.decoder.layers if hasattr(x.mlp, "router"))
        load = MoELoad(m)
        S, H = 12, glm5.hidden_size
        x = torch.randn(S, 1, H, generator=torch.Generator().manual_seed(0)).to(dev)
        mask = torch.tensor([True] * 9 + [False] * 3, device=dev)
        load.token_mask = mask
        routed = []
        hook = layer.mlp.router.register_forward_hook(lambda mod, inp, out: routed.append(host(out[1])))
        with count_host_reads() as reads:
            with torch.no_grad():
                layer.mlp(x)
        hook.remove()
        name = next(iter(load.counts))
        counts = host(load.counts[name])
    mine = [r for r in reads.reads if "training/loop.py" in r[1]]
    assert mine == [], mine
    assert torch.equal(counts, routed[0][:9].float().sum(0))
