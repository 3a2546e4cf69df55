"""G8: the local spec's MLA q/kv down projections keep TP-aware checkpoint replicas (``cpu_compat``'s
``DuplicatedLinear``) when Transformer Engine is installed too, where Megatron-Core's MLA module imports modelopt's
``Linear`` itself (multi_latent_attention.py:60-69) whose replicas ignore TP (every TP rank the main one)."""


def test_local_spec_down_projections_keep_tp_replicas_with_te_installed(monkeypatch):
    from megatron.core.post_training.modelopt.layers import Linear as ModeloptLinear
    from megatron.core.transformer import multi_latent_attention as mla

    from glm5_mcore import cpu_compat

    monkeypatch.setattr(mla, "Linear", ModeloptLinear)  # what MLA's module holds with TE installed
    cls = cpu_compat.mla_replicated_down_proj()  # the local spec's down projection (layer_spec)
    assert cls is not ModeloptLinear and issubclass(cls, ModeloptLinear), cls
    assert mla.Linear is cls  # MLA matches the spec's down projection against this name
    assert cls.sharded_state_dict is not ModeloptLinear.sharded_state_dict  # the TP group in its replicas
