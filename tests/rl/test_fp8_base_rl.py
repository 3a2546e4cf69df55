"""GRPO on a frozen FP8 base (``model.base_dtype=fp8``), in-process (no Ray): the trainer's old log-probs equal
the engine's on the same (dequantized) base, and a run of updates gives the metrics, step by step, of the run
whose trainer holds that base dequantized to fp32 (CPU runs are fp32; the bf16 trainer needs CUDA)."""

import numpy as np
import pytest
from safetensors.torch import load
from transformers import AutoTokenizer

from tests.support.helpers import fp8_folders
from tests.support.rl_setup import rl_steps, rl_cfg

STEPS = 4
KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score_mean")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return fp8_folders(tmp_path_factory.mktemp("fp8rl"))


def _run(hf_dir, base_dtype, engine_dir):
    from glm5_mcore.model.fp8_linear import BlockFP8Weight
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    cfg = rl_cfg(str(hf_dir), model={"hf_dir": str(hf_dir), "base_dtype": base_dtype},
                 rollout={"n": 4, "max_new_tokens": 6, "temperature": 1.0},
                 actor={"lr": 1e-2, "ppo_mini_batch_size": 4}, data={"prompts_per_step": 4})
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    trainer = PolicyTrainer(cfg)
    assert any(isinstance(p, BlockFP8Weight) for p in trainer.model.parameters()) == (base_dtype == "fp8")
    engine = HFRolloutEngine(str(engine_dir))  # serves the dequantized values (the HF engine reads no FP8)
    hist, agree = [], []
    for batch, m in rl_steps(cfg, trainer, engine, tok, STEPS, 64):
        agree.append(float((batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs().max()))
        m["critic/score_mean"] = float(batch.scores.mean())
        hist.append(m)
    a = trainer.export_adapter(STEPS)
    return hist, agree, a


def test_grpo_on_fp8_base_matches_the_fp32_base(folders):
    fp8, dense = folders
    h8, agree8, a8 = _run(fp8, "fp8", dense)
    h32, agree32, a32 = _run(dense, None, dense)
    assert max(agree8) <= 1e-5 and max(agree32) <= 1e-5, (agree8, agree32)  # trainer vs engine, as for fp32
    for k in KEYS:
        x, y = np.array([m[k] for m in h8]), np.array([m[k] for m in h32])
        assert np.isfinite(x).all() and np.abs(x - y).max() <= 1e-5, (k, x, y)
    assert max(m["actor/grad_norm"] for m in h8) > 0
    t8, t32 = (load(a.files["adapter_model.safetensors"]) for a in (a8, a32))
    assert t8.keys() == t32.keys() and len(t8) > 10
    assert max(float((t8[k] - t32[k]).abs().max()) for k in t8) <= 1e-5  # the same adapter after the run
