"""The vocabulary padded for TP (``glm5_mcore.model.vocab``): Megatron-LM's padded size, and a padded model that
computes exactly the unpadded one — logits against transformers, the SFT and MTP cross entropy, RL's
vocab-parallel log-probs and entropy, gradients (the padded rows get none). One rank here, the vocabulary
padded by ``make_vocab_size_divisible_by`` (129 -> 256 rows, 127 of them padding); TP 2 on the same odd
vocabulary is in ``tests/layouts``."""

import pytest
import torch

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig, padded_vocab_size
from glm5_mcore.model.build import build_model, forward_logits
from glm5_mcore.checkpoint.hf_load import load_hf_weights
from glm5_mcore.model.mtp_loss import model_token_logprobs, mtp_depth_losses
from glm5_mcore.model.vocab import VOCAB_PARALLEL
from glm5_mcore.parity import load_input_ids, run_parity

PADDED = ParallelConfig(make_vocab_size_divisible_by=128)


def test_padded_vocab_size_is_megatron_lms():
    """Megatron-LM's ``_vocab_size_with_padding``: up to a multiple of divisible_by × tp."""
    assert padded_vocab_size(129, 2) == 130 and padded_vocab_size(129, 1) == 129
    assert padded_vocab_size(154880, 8) == 154880  # GLM-5's own vocabulary: no padding at TP 8
    assert padded_vocab_size(154880, 8, 128) == 155648 and padded_vocab_size(129, 1, 128) == 256
    assert padded_vocab_size(154881, 8) == 154888
    with pytest.raises(ValueError, match="^make_vocab_size_divisible_by: must be >= 1"):
        ParallelConfig(make_vocab_size_divisible_by=0).validate(GLM5Config())


def test_padded_model_equals_transformers(tiny_odd_dir, single_rank):
    ids = load_input_ids(None, 129, 2, 32, seed=3)
    ids[0, :4] = 128  # the last real id
    rep = run_parity(tiny_odd_dir, ids, PADDED)
    assert rep["vocab_rows"] == 256 and rep["shape"] == [2, 32, 129], rep
    assert rep["max_abs"] <= 1e-5 and rep["topk_agree"] == 1.0 and rep["router_agree"] == 1.0, rep


def _run(hf_dir, parallel, ids):
    """(SFT loss [b, s], MTP loss, log-probs and entropy at T=0.7, logits, grads) of one forward+backward."""
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    m = build_model(glm5, parallel)
    load_hf_weights(m, hf_dir, glm5)
    S = ids.shape[1] - 1
    pos = torch.arange(S)[None].expand(ids.shape[0], -1)
    loss = m(ids[:, :-1], pos, None, labels=ids[:, 1:])
    loss.mean().backward()
    mtp = mtp_depth_losses(glm5.num_nextn_predict_layers)
    grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    m.eval()
    with torch.no_grad():
        lp, ent = model_token_logprobs(m, ids[:, :-1], pos, ids[:, 1:], temperature=0.7)
        logits = forward_logits(m, ids[:, :-1])
    return {"loss": loss.detach(), "mtp": mtp["mtp_loss/depth_1"], "lp": lp, "ent": ent, "logits": logits,
            "grads": grads, "rows": m.output_layer.weight.shape[0]}


def test_padded_logits_stay_out_of_every_loss_and_log_prob(tiny_odd_dir, single_rank):
    """The same weights with 127 padding rows: the SFT loss, the MTP loss, log-probs and entropy equal the
    unpadded model's; the padded output-layer rows get zero gradient, every other gradient is the same."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 129, (2, 25), generator=g)
    ids[:, 3:6] = 128
    plain, padded = _run(tiny_odd_dir, ParallelConfig(), ids), _run(tiny_odd_dir, PADDED, ids)
    assert (plain["rows"], padded["rows"]) == (129, 256)
    for k in ("loss", "lp", "ent", "logits"):
        assert torch.isfinite(padded[k]).all(), k
        diff = float((padded[k] - plain[k]).abs().max())
        assert diff <= 1e-6, (k, diff)
    assert padded["mtp"] == pytest.approx(plain["mtp"], rel=1e-6)
    pad_grad = padded["grads"]["output_layer.weight"][129:]
    assert pad_grad.abs().max() == 0 and padded["grads"]["embedding.word_embeddings.weight"][129:].abs().max() == 0
    worst = max(float((padded["grads"][n][:129] if n in VOCAB_PARALLEL else padded["grads"][n]).sub(p).abs().max())
                for n, p in plain["grads"].items())
    assert worst <= 1e-6, worst


def test_glm5_tiny_writes_an_odd_vocabulary(tmp_path, capsys):
    """``glm5 tiny --vocab-size 129``: the config, embedding, lm_head and tokenizer all of 129 ids."""
    from transformers import AutoTokenizer

    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from recipes.main import main

    assert main(["tiny", "--out", str(tmp_path / "t"), "--vocab-size", "129"]) == 0
    ck = HFCheckpoint(tmp_path / "t")
    assert GLM5Config.from_hf_dir(tmp_path / "t").vocab_size == 129 == len(AutoTokenizer.from_pretrained(tmp_path / "t"))
    assert ck.get("lm_head.weight").shape == ck.get("model.embed_tokens.weight").shape == (129, 64)
    assert main(["tiny", "--out", str(tmp_path / "u"), "--vocab-size", "9"]) == 2
    assert "--vocab-size 9: must exceed the 9 special tokens" in capsys.readouterr().err
    assert not (tmp_path / "u").exists()
    # an absurd size: one line (it ended in the allocator's traceback), nothing written
    assert main(["tiny", "--out", str(tmp_path / "u"), "--vocab-size", "1099511627776"]) == 2
    err = capsys.readouterr().err
    print(err)
    assert err.splitlines() == ["glm5 tiny: error: --vocab-size 1099511627776: at most 1048576 for a tiny model (its "
                                "embedding and output layer alone would take 524,288 GiB in fp32)"], err
    assert not (tmp_path / "u").exists()
