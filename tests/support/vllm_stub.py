"""A ``VLLMRolloutEngine`` without vLLM: the push logic (merge, buckets, draft reloads) against a recording
server, for tests that check what an engine would send (``tests/gpu/test_gpu_path.py``, ``tests/rl/test_mtp.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class RecordingServer:
    """Stands in for ``vllm_server.Server`` behind the engine: records each reload's tensors and the torch
    thread count it ran under."""

    def __init__(self):
        self.calls, self.threads = [], []

    def call(self, method, *args):
        from safetensors.torch import load_file

        self.threads.append(torch.get_num_threads())
        self.calls.append((method, load_file(args[0])))
        return len(self.calls[-1][1])


def recording_engine(hf_dir, tmp_path, merge: bool, drafts: bool = False):
    """The engine's state as ``VLLMRolloutEngine.__init__`` leaves it for a separate (file-transport) engine,
    with a ``RecordingServer`` instead of vLLM."""
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.rollout.vllm_stream import EngineStream

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    e = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    e.hf_dir, e.merge, e.drafts, e.push_bytes, e.lora, e._pushed = hf_dir, merge, drafts, 2 << 30, None, set()
    e.num_hidden_layers, e.n_experts = config["num_hidden_layers"], int(config.get("n_routed_experts") or 1)
    e._dir, e.server, e.device, e.push_threads = str(tmp_path), RecordingServer(), None, 2
    e.sleep_mode, e.transport, e.sync_log, e._discarded = False, "file", [], False
    e.stream, e.payload_version, e._deferred = EngineStream(), -1, None  # no stream requests: pushes go at once
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    return e
