"""What a ``VLLMRolloutEngine`` has pushed into its vLLM server, and how each push gets there.

- ``ServedWeights``: merged tensors (``rl.rollout.vllm_weights.iter_merged_weights``) reloaded in place, one
  safetensors file at a time (``transport="file"``, separate engines) or as ``rl.rollout.weight_sync`` buckets
  (``"handles"``: CUDA IPC on GPUs, colocated engines): the decoder's tensors into the served model, the MTP
  layer's into the speculative draft model. It remembers which HF tensors differ from the base, so the next push
  restores them (never cumulative) and a level-2 sleep can bring every weight back.
- ``AdapterVersions``: LoRA mode's adapters on the server, one vLLM LoRA id per pushed version. A request runs
  under the version it was admitted with; a version leaves the server (``Server.remove_adapter``) once it is
  neither the newest nor used by a live request. The tensors travel in memory (``Server.add_adapter``: the PEFT
  safetensors bytes through the server's channel, then ``LLM.collective_rpc`` to its workers).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from rl.rollout import weight_sync
from rl.rollout.vllm_lora import ServedAdapter
from rl.rollout.vllm_weights import HF_LAYER, is_mtp_tensor, iter_merged_weights


class ServedWeights:
    """The merged tensors an engine's server holds (``pushed``: HF names that differ from the base)."""

    def __init__(self, server, hf_dir: str, num_hidden_layers: int, n_experts: int, drafts: bool, transport: str,
                 push_bytes: int, push_threads: int, work_dir: str, device: Optional[str]):
        if transport not in ("file", "handles"):
            raise ValueError(f"weight_transport={transport!r}: file (separate engines) or handles "
                             "(colocated: rl.rollout.weight_sync buckets, CUDA IPC on GPUs)")
        self.server, self.hf_dir, self.L, self.n_experts, self.drafts = server, hf_dir, num_hidden_layers, n_experts, drafts
        self.transport, self.push_bytes, self.push_threads = transport, push_bytes, push_threads
        self.dir, self.device = work_dir, device
        self.pushed: set[str] = set()
        self.log: list[dict] = []
        """Per push: {"buckets", "bytes"} (handles transport), "merged_bytes" and "seconds"."""

    def all_weights(self) -> tuple:
        """Every HF tensor the served model loads (after a level-2 sleep all of them come back)."""
        from glm5_mcore.checkpoint.hf_io import HFCheckpoint

        out = []
        for h in HFCheckpoint(self.hf_dir).keys():
            if h.endswith("_scale_inv") or (not self.drafts and is_mtp_tensor(h, self.L)):
                continue
            fused = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", h)
            if fused:  # transformers' fused expert tensors: the per-expert names vLLM's loader takes
                kinds = ("down_proj",) if fused.group(2) == "down_proj" else ("gate_proj", "up_proj")
                out += [f"{fused.group(1)}.{e}.{k}.weight" for e in range(self.n_experts) for k in kinds]
            else:
                out.append(h)
        return tuple(out)

    def push(self, chunks, changed: Optional[set] = None) -> dict:
        """Reload each dict of ``chunks`` (HF names → tensors) in vLLM; ``{}``: every tensor pushed before goes
        back to base. ``changed``: the names that now differ from the base (the others pushed were restored);
        None: all of them. Returns {"merged_bytes", "seconds"} (and the buckets with the handles transport)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.push_threads)
        t0 = time.perf_counter()
        try:
            entry = self._push_chunks(chunks)
        finally:
            torch.set_num_threads(threads)
        if chunks == {} or changed is not None:
            self.pushed &= set() if chunks == {} else changed
        entry["seconds"] = time.perf_counter() - t0
        self.log.append(entry)
        return entry

    def _push_chunks(self, chunks) -> dict:
        if chunks == {}:  # base model again: every pushed tensor from the base shards
            chunks = iter_merged_weights(self.hf_dir, None, tuple(self.pushed), self.push_bytes, "all")
        pushed, buckets, nbytes = set(), [], 0
        file = Path(self.dir) / "merged.safetensors"
        for weights in chunks:
            draft = {h: w for h, w in weights.items() if is_mtp_tensor(h, self.L)}
            nbytes += sum(w.numel() * w.element_size() for w in weights.values())
            for method, part in (("reload", {h: w for h, w in weights.items() if h not in draft}),
                                 ("reload_draft", draft)):
                if not part:
                    continue
                if self.transport == "handles":
                    buckets += self._send_buckets(method, part)
                    continue
                save_file(part, str(file))
                try:
                    self.server.call(method, str(file))
                finally:
                    file.unlink(missing_ok=True)
            names = {h for h in weights if not h.endswith("_scale_inv")}
            pushed |= names
            self.pushed |= names  # a failure mid-way still restores these with the next push
        self.pushed = pushed
        entry = {"merged_bytes": nbytes}
        if self.transport == "handles":  # as ``Server.reload`` does per file: no KV of the old weights served
            self.server.call("reset_prefix_cache")
            entry.update(buckets=[b["names"] for b in buckets], bytes=sum(b["bytes"] for b in buckets))
        return entry

    def _send_buckets(self, method: str, part: dict) -> list[dict]:
        """``part`` to vLLM as ``rl.rollout.weight_sync`` buckets of whole decoder layers (at most ``push_bytes``
        unless one layer is larger: the granularity the file path reloads), each handed over as a CUDA IPC handle
        on GPUs (the bucket built on the engine's GPU) or the shared-file stand-in on the CPU."""
        cuda = torch.cuda.is_available() and self.device != "cpu"
        codec = weight_sync.codec("cuda_ipc" if cuda else "shared_file")

        def group_of(h: str) -> str:  # whole decoder layers, as the file path's chunks (iter_merged_weights):
            m = HF_LAYER.match(h)         # vLLM's MoE gate (weight + e_score_correction_bias) and MLA modules
            return f"model.layers.{m.group(1)}" if m else h  # rebuild from what one reload brings

        return weight_sync.send([part], self.push_bytes, codec,
                                lambda handle, metas: self.server.call(method + "_handle", handle, metas, codec.name),
                                group_of, torch.device("cuda", torch.cuda.current_device()) if cuda else None)

    def decoder_pushed(self) -> bool:
        """Whether a decoder tensor differs from the base now (restoring it changes what live requests see)."""
        return any(not is_mtp_tensor(h, self.L) for h in self.pushed)


class AdapterVersions:
    """LoRA mode's adapter versions on the server: payload version → (name, vLLM LoRA id, routed experts in 3D)."""

    def __init__(self, server):
        self.server = server
        self.by_version: dict[int, tuple] = {}
        self.next_id = 1
        self.log: list[dict] = []
        """Per ``add``: {"version", "lora_bytes", "seconds", "modules"}."""

    def add(self, version: int, adapter: ServedAdapter) -> tuple:
        """Hold ``adapter`` on every worker as a new LoRA; returns its request tuple (``vllm_adapters.lora_request``)."""
        lora = (f"policy_v{version}", self.next_id, adapter.routed)
        self.next_id += 1
        t0 = time.perf_counter()
        modules = self.server.call("add_adapter", lora[0], lora[1], adapter.config, adapter.data, adapter.routed)
        self.log.append({"version": version, "lora_bytes": adapter.nbytes, "seconds": time.perf_counter() - t0,
                         "modules": len(modules)})
        self.by_version[version] = lora
        return lora

    def retire(self, keep: set) -> list[int]:
        """Remove every version not in ``keep`` (the newest and those of live requests); the versions removed."""
        gone = sorted(v for v in self.by_version if v not in keep)
        for v in gone:
            self.server.call("remove_adapter", self.by_version.pop(v)[1])
        return gone
