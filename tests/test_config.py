import json

import pytest

from glm5_mcore.config import GLM5Config, glm5_744b, glm5_tiny, warn_if_dsa_inactive


from glm5_mcore.mcore_settings import ParallelConfig
def test_hf_dict_round_trip_and_transformers_agree():
    from transformers import GlmMoeDsaConfig

    for cfg in (glm5_tiny(), glm5_tiny(mtp=True, index_share=True), glm5_744b()):
        d = cfg.to_hf_dict()
        again = GLM5Config.from_hf_dict(json.loads(json.dumps(d)))
        assert again.to_hf_dict() == d
        hf = GlmMoeDsaConfig(**d)
        assert hf.indexer_types == cfg.indexer_types
        assert hf.mlp_layer_types == cfg.mlp_layer_types
        assert hf.rope_parameters["rope_theta"] == cfg.rope_theta == 1e6


@pytest.mark.parametrize("freq,offset", [(1, 2), (2, 2), (3, 1), (2, 1)])
def test_index_share_schedule_has_hf_semantics(freq, offset):
    from transformers import GlmMoeDsaConfig

    d = glm5_tiny().to_hf_dict()
    d.update(num_hidden_layers=7, index_topk_freq=freq, index_skip_topk_offset=offset)
    d.pop("indexer_types"), d.pop("mlp_layer_types")
    ours = GLM5Config.from_hf_dict(d)
    assert ours.indexer_types == GlmMoeDsaConfig(**d).indexer_types


def test_real_glm5_config_maps_to_megatron():
    cfg = glm5_744b()
    m = cfg.to_mcore_config(ParallelConfig(tp=8, ep=32))
    assert (m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (192, 64, 256)
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias
    assert m.moe_router_bias_update_rate == 0.0 and m.moe_router_topk_scaling_factor == 2.5
    assert m.moe_layer_freq == [0, 0, 0] + [1] * 75
    assert m.moe_shared_expert_intermediate_size == 2048
    assert m.rotary_base == 1e6 and m.dsa_indexer_rope_interleaved and not m.dsa_indexer_rotate_activation
    assert m.dsa_indexer_k_norm_epsilon == 1e-6 and m.layernorm_epsilon == 1e-5
    assert m.mtp_num_layers == 1 and m.sequence_parallel


@pytest.mark.parametrize("field,value", [
    ("index_topk", 0), ("model_type", "deepseek_v32"), ("num_key_value_heads", 2),
    ("norm_topk_prob", False), ("indexer_rope_interleave", False), ("attention_bias", True),
    ("index_topk_pattern", "SFFF"),
])
def test_bad_config_names_the_field(field, value):
    d = glm5_tiny().to_hf_dict()
    d.pop("indexer_types")
    d[field] = value
    with pytest.raises(ValueError, match=field if field != "index_topk_pattern" else "indexer_types"):
        GLM5Config.from_hf_dict(d)


@pytest.mark.parametrize("kw,field", [({"tp": 3}, "tp"), ({"ep": 3}, "ep"), ({"pp": 3}, "pp")])
def test_impossible_layout_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        glm5_tiny().to_mcore_config(ParallelConfig(**kw))


def test_tp_not_dividing_an_mlp_width_is_one_line_from_the_config(tmp_path, capfd):
    """TP 2 on a model whose dense MLP is 37 wide (transformers' ``GlmMoeDsaModelTester``'s intermediate_size), or
    whose shared expert is 13: ``glm5 parity --tp 2`` says so in one line before any rank builds, and the SFT
    recipe's checks name ``parallel.tp`` and the field (it was Megatron-Core's ``ensure_divisibility`` traceback
    on every rank)."""
    import dataclasses

    from glm5_mcore.tiny import random_hf_state_dict, write_hf_checkpoint
    from recipes.main import main
    from recipes.sft import validate

    from tests.support.sft_setup import sft_cfg

    for field, cfg, why in (
            ("intermediate_size", dataclasses.replace(glm5_tiny(), intermediate_size=37),
             "intermediate_size=37 (the dense MLP's width, split over TP)"),
            ("moe_intermediate_size", dataclasses.replace(glm5_tiny(), moe_intermediate_size=13),
             "moe_intermediate_size=13 x n_shared_experts=1 (the shared expert's width, split over TP)")):
        hf = write_hf_checkpoint(cfg, random_hf_state_dict(cfg), tmp_path / field)
        capfd.readouterr()
        assert main(["parity", "--hf-dir", str(hf), "--tp", "2"]) == 2
        err = capfd.readouterr().err
        print(err)
        assert err.splitlines() == [f"glm5 parity: error: --tp: {why} is not divisible by tp=2"], err
        with pytest.raises(ValueError) as e:
            validate(sft_cfg(str(hf), tmp_path / f"sft_{field}", parallel={"tp": 2}), cfg, 2)
        assert str(e.value) == f"parallel.tp: {why} is not divisible by tp=2", e.value


def test_missing_and_malformed_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        GLM5Config.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        GLM5Config.from_hf_dir(tmp_path)


def test_footguns_warn():
    with pytest.warns(UserWarning, match="does nothing"):
        warn_if_dsa_inactive(glm5_tiny(), seq_len=8)
    with pytest.warns(UserWarning, match="drift"):
        glm5_tiny().to_mcore_config(moe_router_bias_update_rate=1e-3)
    d = glm5_tiny().to_hf_dict()
    d.pop("rope_parameters")
    with pytest.warns(UserWarning, match="rope_theta"):
        GLM5Config.from_hf_dict(d)
