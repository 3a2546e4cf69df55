"""LoRA SFT on a frozen FP8 base (``model.base_dtype=fp8``) learns as the run on the same base dequantized to
fp32 does (CPU runs are fp32; the bf16 trainer needs CUDA): the same losses step by step, falling."""

import pytest

from recipes.sft import run

from tests.support.helpers import fp8_folders
from tests.support.sft_setup import sft_cfg


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return fp8_folders(tmp_path_factory.mktemp("fp8sft"))


def test_lora_sft_on_fp8_base_learns_as_the_fp32_base(folders, tmp_path):
    fp8, dense = folders
    runs = {}
    for name, hf_dir, base in (("fp8", fp8, "fp8"), ("fp32", dense, None)):
        cfg = sft_cfg(str(hf_dir), tmp_path / name, model={"hf_dir": str(hf_dir), "base_dtype": base},
                      lora={"enabled": True, "rank": 8, "alpha": 16},
                      optim={"lr": 1e-2, "decay_style": "constant"})
        runs[name] = run(cfg)
    a, b = ([h["loss"] for h in runs[k]["history"]] for k in ("fp8", "fp32"))
    assert len(a) == 20
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= 1e-5, f"per-step loss max |diff| {worst:.3g}: {a} vs {b}"
    assert sum(a[-3:]) / 3 < 0.8 * sum(a[:3]) / 3, a  # it learns
    (va, vb) = (runs[k]["val"][-1][1] for k in ("fp8", "fp32"))
    assert abs(va - vb) <= 1e-5 and va < runs["fp8"]["val"][0][1]


def test_full_fine_tuning_on_an_fp8_base_is_refused(folders, tmp_path):
    fp8, _ = folders
    cfg = sft_cfg(str(fp8), tmp_path, model={"hf_dir": str(fp8), "base_dtype": "fp8"})
    with pytest.raises(ValueError, match=r"^model.base_dtype=fp8 keeps the frozen base in the checkpoint's FP8 bytes"):
        run(cfg)
    assert not (tmp_path / "run").exists()
