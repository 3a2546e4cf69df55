"""The LoRA parity certificate against transformers + PEFT (no vLLM): for each adapter family alone (MLA
up/down, ``kv_b_proj``, the DSA indexer, dense MLP, shared expert, routed experts) and all together, with
B != 0, our log-probs vs PEFT's on transformers' ``GlmMoeDsaForCausalLM`` loading our exported adapter,
fp32, ``index_topk`` (8) < sequence (32) so the indexer's adapter moves the selection's scores. A family
deliberately dropped from the adapter must fail the check (``applied`` 0). See ``tests.support.certificate``."""

import torch

from glm5_mcore.lora.apply import apply_lora, disable_adapters
from glm5_mcore.lora.config import EXPERTS, INDEXER, MLA, MLP, LoRAConfig
from glm5_mcore.lora.peft import export_peft
from glm5_mcore.lora.state import gather_adapter
from glm5_mcore.model.build import forward_logits
from glm5_mcore.parity import load_input_ids

from tests.support.certificate import FAMILIES, drop_from_adapter, keep_families, randomize_adapters, row, table
from tests.support.helpers import hf_model, peft_model


def _token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) [B, S-1]."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_peft_certificate_every_family_applied_and_a_dropped_one_fails(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    m, glm5 = hf_model(tiny_dir)
    apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=MLA + MLP + EXPERTS + INDEXER, init="random"),
               freeze_indexer=False)
    m.eval()
    saved = randomize_adapters(m, seed=3)
    ids = load_input_ids(None, glm5.vocab_size, 2, 32, seed=4)
    with torch.no_grad():
        with disable_adapters(m):
            base = _token_log_probs(forward_logits(m, ids), ids)
        hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
        rows = [row("base", base, _token_log_probs(hf(ids).logits, ids), base)]

        def certify(label, families, drop=None):
            keep_families(m, saved, families)
            ours = _token_log_probs(forward_logits(m, ids), ids)
            out = export_peft(gather_adapter(m, "default"), glm5.num_hidden_layers, glm5.n_routed_experts,
                              tmp_path / label)
            if drop is not None:
                files = {p.name: p.read_bytes() for p in out.iterdir()}
                for name, data in drop_from_adapter(files, drop).items():
                    (out / name).write_bytes(data)
            pm, unexpected, missing = peft_model(tiny_dir, out)
            assert unexpected == [] and (drop is not None or missing == []), (label, unexpected, missing)
            rows.append(row(label, ours, _token_log_probs(pm(ids).logits, ids), base))

        for fam in FAMILIES:
            certify(fam, [fam])
        certify("all", list(FAMILIES))
        certify("routed dropped", ["routed"], drop="routed")
    print("\npeft certificate:\n" + table(rows))
    *good, dropped = rows
    assert all(r.ok for r in good), table(rows)
    assert not dropped.ok and abs(dropped.applied) < 0.01, table(rows)  # the check catches the drop
