"""mcore-to-hf at full-size proportions: layers several times the output shard are loaded in slices
of their experts (``glm5_mcore.convert.layer_slices``, ``dcp_pieces``) and the round trip stays bit-exact."""

import pytest
import torch

from glm5_mcore.convert.layer_slices import slice_units


def test_slice_units_keep_order_and_budget():
    groups = {"embedding": ["e"], "layer": ["a", "b", "c", "d", "e2"], "big": ["x"]}
    nbytes = {"e": 5, "a": 3, "b": 3, "c": 3, "d": 1, "e2": 4, "x": 50}
    units = slice_units(groups, nbytes, budget=6)
    assert units == [("embedding", ["e"]), ("layer[1/3]", ["a", "b"]), ("layer[2/3]", ["c", "d"]),
                     ("layer[3/3]", ["e2"]), ("big[1/1]", ["x"])]
    assert [n for _, names in units for n in names] == [n for names in groups.values() for n in names]
    with pytest.raises(ValueError, match="budget"):
        slice_units(groups, nbytes, 0)


def test_layers_3x_the_shard_round_trip_bit_exact_in_slices(tmp_path):
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.convert import mcore_to_hf as convert  # the module: mcore_to_hf and its GroupLoader
    from glm5_mcore.convert.common import meta_model
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from glm5_mcore.tiny import write_tiny

    src = write_tiny(tmp_path / "hf", mtp=True)
    ck = hf_to_mcore(src, tmp_path / "mc", progress=False)
    shard = 48 * 1024
    seen = []
    stream = convert.GroupLoader.stream

    def spy(self, units, ahead=True):
        seen.extend(units)
        return stream(self, units, ahead)

    convert.GroupLoader.stream = spy
    try:
        back = convert.mcore_to_hf(ck, tmp_path / "back", max_shard_size=shard, progress=False)
    finally:
        convert.GroupLoader.stream = stream
    a, b = HFCheckpoint(src), HFCheckpoint(back)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k
    model = meta_model(GLM5Config.from_hf_dir(src), torch.float32)
    layer = sum(t.numel() * 4 for n, t in model.state_dict(keep_vars=True).items()
                if n.startswith("decoder.layers.1.") and not n.endswith("_extra_state"))
    assert layer >= 3 * shard  # the MoE layer is at least 3 output shards
    sliced = [label for label, _ in seen if label.startswith("decoder.layers.1[")]
    assert len(sliced) >= 12 and sliced[-1].endswith(f"[{len(sliced)}/{len(sliced)}]")
    assert max(sum(model.state_dict(keep_vars=True)[n].numel() * 4 for n in names) for _, names in seen
               if len(names) > 1) <= shard // 4


def test_missing_piece_is_named(tmp_path):
    from glm5_mcore.checkpoint.dcp_pieces import _PiecePlanner

    class MD:
        state_dict_metadata = {}

    p = _PiecePlanner({"decoder.layers.1.mlp.experts.experts.linear_fc1.weight": [((0, 0, 0), torch.zeros(1, 2, 2))]},
                      "ckpt/model")
    p.set_up_planner({}, MD())
    with pytest.raises(ValueError, match="ckpt/model: no tensor 'decoder.layers.1.mlp.experts.experts.linear_fc1"):
        p.create_local_plan()
