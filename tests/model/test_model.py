"""The Megatron-Core GLM-5 against transformers' GlmMoeDsaForCausalLM (fp32, 1 thread, no hub)."""

import sys

import pytest
import torch

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.model.build import build_model, forward_logits, packed_seq_params_from_lengths
from glm5_mcore.checkpoint.hf_load import load_hf_weights
from glm5_mcore.parity import load_input_ids, run_parity

from tests.support.launch import run_child

SEQ = 32  # > index_topk = 8, so the indexer really drops keys


def _model(hf_dir, **glm5_overrides):
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    for k, v in glm5_overrides.items():
        setattr(glm5, k, v)
    m = build_model(glm5, ParallelConfig())
    load_hf_weights(m, hf_dir, glm5)
    return m.eval(), glm5


@pytest.mark.parametrize("which", ["tiny_dir", "tiny_share_dir", "tiny_mtp_dir"])
def test_logits_match_transformers(which, request, single_rank):
    from megatron.core.models.gpt import GPTModel

    hf_dir = request.getfixturevalue(which)
    ids = load_input_ids(None, 128, 2, SEQ, seed=3)
    report = run_parity(hf_dir, ids, ParallelConfig())
    print(report)
    assert report["max_abs"] <= 1e-5, report
    assert report["topk_agree"] == 1.0 and report["router_agree"] == 1.0, report
    assert report["pass"] is True
    m, _ = _model(hf_dir)
    assert isinstance(m, GPTModel)


def test_sparsity_is_real(tiny_dir, single_rank):
    ids = load_input_ids(None, 128, 1, SEQ, seed=4)
    sparse, _ = _model(tiny_dir)
    dense, _ = _model(tiny_dir, index_topk=SEQ)
    with torch.no_grad():
        diff = (forward_logits(sparse, ids) - forward_logits(dense, ids)).abs().max()
    assert diff > 1e-2, float(diff)


def test_thd_packed_documents_equal_each_document_alone(tiny_share_dir, single_rank):
    m, _ = _model(tiny_share_dir)
    lengths = [20, 13, 27]
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 128, (1, n), generator=g) for n in lengths]
    packed = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = forward_logits(m, packed, pos, packed_seq_params_from_lengths(lengths))
        alone = torch.cat([forward_logits(m, d) for d in docs], dim=1)
    assert (out - alone).abs().max() <= 1e-5, float((out - alone).abs().max())


def test_mtp_layer_math_and_loss_gradients(tiny_mtp_dir, single_rank):
    m, glm5 = _model(tiny_mtp_dir)
    m.train()
    mtp = m.mtp.layers[0]
    seen = {}
    mtp.eh_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("eh_in", inp[0].detach()))
    m.decoder.final_layernorm.register_forward_hook(
        lambda mod, inp, out: seen.setdefault("h", inp[0].detach()))
    ids = load_input_ids(None, 128, 2, SEQ + 1, seed=6)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    loss = m(tokens, torch.arange(SEQ)[None].expand(2, -1), None, labels=labels)
    # eh_proj input = cat[enorm(emb(x_{t+1})), hnorm(h_t)]: embedding first, hidden second
    emb = m.embedding.word_embeddings.weight[torch.roll(tokens, -1, dims=1)].transpose(0, 1)
    expect = torch.cat([mtp.enorm(emb), mtp.hnorm(seen["h"])], dim=-1)
    got = seen["eh_in"]
    assert (got[:-1] - expect[:-1]).abs().max() < 1e-5
    assert mtp.mtp_model_layer.self_attention.core_attention.indexer is not None
    assert type(mtp.mtp_model_layer.mlp).__name__ == "MoELayer"
    loss.float().mean().backward()
    grads = [p.grad for n, p in mtp.named_parameters() if p.requires_grad and "indexer" not in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    assert m.config.mtp_loss_scaling_factor == 0.1


def test_three_optimizer_steps_lower_the_loss(tiny_mtp_dir, single_rank):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from glm5_mcore.model.indexer_stages import set_indexer_frozen
    from tests.support.helpers import megatron_steps

    m, _ = _model(tiny_mtp_dir)
    m.train()
    assert set_indexer_frozen(m) > 0
    m = DistributedDataParallel(m.config, DistributedDataParallelConfig(), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), [m])
    indexer_params = {id(p) for n, p in m.named_parameters() if ".indexer." in n}
    opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert indexer_params and not indexer_params & opt_params  # frozen: no optimizer state
    losses = megatron_steps(m, opt, load_input_ids(None, 128, 2, SEQ + 1, seed=7), 4)
    assert losses[3] < losses[2] < losses[1] < losses[0], losses


@pytest.mark.slow
def test_model_code_imports_no_transformers():
    code = ("import sys, glm5_mcore.config, glm5_mcore.model.build, glm5_mcore.model.dsa, glm5_mcore.model.layer_spec, "
            "glm5_mcore.checkpoint.hf_names, glm5_mcore.checkpoint.hf_io, glm5_mcore.cpu_compat, glm5_mcore.tiny; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    run_child([sys.executable, "-c", code])


def test_wrong_shape_and_missing_tensor_are_named(tiny_dir, tmp_path, single_rank):
    from safetensors.torch import load_file, save_file

    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "manifest.json").unlink()  # edited by hand below: a folder we did not write
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = sd["model.layers.1.self_attn.kv_b_proj.weight"][:-1]
    del sd["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(sd, bad / "model.safetensors")
    glm5 = GLM5Config.from_hf_dir(bad)
    m = build_model(glm5, ParallelConfig())
    with pytest.raises(ValueError, match="kv_b_proj"):
        load_hf_weights(m, bad, glm5)
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(128, 16)
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(KeyError, match="experts.3.up_proj"):
        load_hf_weights(m, bad, glm5)


def test_cli_errors_name_the_file(tmp_path, tiny_dir):
    from recipes.main import main

    assert main(["parity", "--hf-dir", str(tmp_path / "nope")]) == 2
    (tmp_path / "ids.safetensors").write_bytes(b"garbage")
    from safetensors.torch import save_file

    save_file({"tokens": torch.zeros(1, 4, dtype=torch.int64)}, tmp_path / "ids.safetensors")
    with pytest.raises(ValueError, match="ids.safetensors"):
        load_input_ids(str(tmp_path / "ids.safetensors"), 128, 1, 4, 0)
