"""A ``VLLMRolloutEngine`` without vLLM: the push logic (merge, LoRA versions, buckets, draft reloads) against a
recording server, for tests that check what an engine would send (``tests/gpu/test_gpu_path.py``,
``tests/rl/test_mtp.py``, ``tests/rl/test_vllm_lora.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class RecordingServer:
    """Stands in for ``vllm_server.Server`` behind the engine: records each reload's tensors (and the torch thread
    count it ran under), each adapter added (its tensors) and removed."""

    def __init__(self):
        self.calls, self.threads = [], []

    def call(self, method, *args):
        from safetensors.torch import load, load_file

        self.threads.append(torch.get_num_threads())
        if method == "add_adapter":
            name, lora_id, config, data, is_3d = args
            self.calls.append((method, {"name": name, "id": lora_id, "config": config, "tensors": load(data),
                                        "is_3d": is_3d}))
            return sorted({k.split(".lora_")[0] for k in self.calls[-1][1]["tensors"]})
        if method == "remove_adapter":
            self.calls.append((method, args[0]))
            return None
        self.calls.append((method, load_file(args[0])))
        return len(self.calls[-1][1])


def recording_engine(hf_dir, tmp_path, merge: bool, drafts: bool = False):
    """The engine's state as ``VLLMRolloutEngine.__init__`` leaves it for a separate (file-transport) engine,
    with a ``RecordingServer`` instead of vLLM."""
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.rollout.vllm_push import AdapterVersions, ServedWeights
    from rl.rollout.vllm_stream import EngineStream
    from rl.rollout.vllm_weights import KEPT_MIN

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    e = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    e.hf_dir, e.merge, e.drafts, e.lora, e.dense_mla, e.kept_min = hf_dir, merge, drafts, None, False, KEPT_MIN
    e.num_hidden_layers, e._dir, e.server, e.device = config["num_hidden_layers"], str(tmp_path), RecordingServer(), None
    e.sleep_mode, e._discarded, e.pushes = False, False, []
    e.stream, e.payload_version, e._deferred = EngineStream(), -1, None  # no stream requests: pushes go at once
    e.weights = ServedWeights(e.server, hf_dir, e.num_hidden_layers, int(config.get("n_routed_experts") or 1), drafts,
                              "file", 2 << 30, 2, str(tmp_path), None)
    e.adapters = AdapterVersions(e.server)
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    return e
