"""Checkpoint conversion throughput and peak memory, against a plain safetensors read of the same files.

Makes a synthetic GLM-5 checkpoint of a few GB (GLM-5 layer structure, sizes scaled down: hidden
2048, 48 routed experts of 512, MLA 768/256, indexer 16x64, 8 layers + the MTP layer, bf16, shards of
1 GB), then runs each step in its own process so each peak RSS is its own:

- read:        safetensors ``safe_open`` + ``get_tensor`` of every tensor (the baseline);
- copy:        ``shutil.copytree`` of the HF folder + sync: what merely writing the bytes costs here;
- hf-to-mcore: ``glm5 convert hf-to-mcore`` (streaming DCP write);
- mcore-to-hf: ``glm5 convert mcore-to-hf`` (layer-at-a-time load, 1 GB output shards; a layer
  bigger than half a shard is loaded in slices of its experts), which first verifies the checkpoint's
  files against its checksum manifest;
- mcore-to-hf (no verify): the same with ``--no-verify`` (``GLM5_VERIFY_CHECKSUMS=0``);
- checksum-verify: ``glm5 checkpoint verify`` of the converted checkpoint alone (xxh3-128 of every file);
- manifest:    writing hf-to-mcore's manifest inside its run (the data files were hashed as they were
  written), and, as its own step, the same manifest hashed back from disk (the cost that avoids);
- verify:      the round trip HF -> Megatron -> HF is bit-exact (every tensor, dtype and bytes).

The page cache is dropped before each step (root only; the JSON says whether it was) and each
writing step ends with ``sync``. Throughput ratio = baseline read time / conversion time on the same
bytes (target >= 0.5x), also shown against the copy;
memory ratio = conversion peak RSS / largest shard it reads (hf-to-mcore) or writes (mcore-to-hf)
(target <= 2x).

Full-size layers (a real GLM-5 MoE layer, ~19 GB, is several 5 GB shards): ``--big-layers`` makes
MoE layers of 160 experts of width 2048 (4.0 GB each, 3.75x the 1 GiB shards):

    .venv/bin/python bench/convert.py --big-layers

Usage: .venv/bin/python bench/convert.py [--workdir DIR] [--layers 8] [--experts 48] [--expert-width 512]
       [--shard-mb 1024] [--big-layers]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHARD_BYTES = 1 << 30


def make_checkpoint(out: Path, layers: int, experts: int, expert_width: int = 512,
                    shard_bytes: int = SHARD_BYTES) -> dict:
    import torch
    from safetensors.torch import save_file

    from glm5_mcore.config import glm5_tiny
    from glm5_mcore.tiny import write_tokenizer

    cfg = glm5_tiny(mtp=True)
    for k, v in dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768,
                     kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                     index_n_heads=16, index_head_dim=64, n_routed_experts=experts, moe_intermediate_size=expert_width,
                     intermediate_size=4096, vocab_size=32000, num_hidden_layers=layers, first_k_dense_replace=1,
                     mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), indexer_types=["full"] * layers,
                     torch_dtype="bfloat16").items():
        setattr(cfg, k, v)
    cfg.validate()
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    write_tokenizer(out, cfg.vocab_size)
    g = torch.Generator().manual_seed(0)

    def tensors():
        from glm5_mcore.tiny import _layer_tensors

        yield "model.embed_tokens.weight", torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
        for i in range(layers + 1):
            moe = i >= 1
            yield from _layer_tensors(cfg, f"model.layers.{i}.", moe, True, g).items()
            if i == layers:
                H = cfg.hidden_size
                yield f"model.layers.{i}.enorm.weight", torch.ones(H)
                yield f"model.layers.{i}.hnorm.weight", torch.ones(H)
                yield f"model.layers.{i}.eh_proj.weight", torch.randn(H, 2 * H, generator=g) / 64
                yield f"model.layers.{i}.shared_head.norm.weight", torch.ones(H)
        yield "model.norm.weight", torch.ones(cfg.hidden_size)
        yield "lm_head.weight", torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) / 45

    shard, size, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for name, t in tensors():
        keep32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        t = t.float() if keep32 else t.bfloat16()
        nb = t.numel() * t.element_size()
        if shard and size + nb > shard_bytes:
            flush()
        shard[name] = t.contiguous()
        size += nb
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sizes = [(out / f).stat().st_size for f in files]
    H, E = cfg.hidden_size, experts
    moe_layer = 3 * E * H * expert_width * 2  # routed experts of one MoE layer, bf16
    return {"bytes": sum(sizes), "largest_shard": max(sizes), "shards": len(files), "moe_layer_bytes": moe_layer}


def _verify(a: Path, b: Path) -> dict:
    """Every tensor of HF folder ``a`` is in ``b`` with the same dtype, shape and bytes."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict:
        return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    ia, ib = index(a), index(b)
    if sorted(ia) != sorted(ib):
        return {"bit_exact": False, "why": f"names differ: {sorted(set(ia) ^ set(ib))[:3]}"}
    with contextlib.ExitStack() as stack:
        open_b = {f: stack.enter_context(safe_open(str(b / f), framework="pt")) for f in set(ib.values())}
        for f in sorted(set(ia.values())):
            with safe_open(str(a / f), framework="pt") as ha:
                for k in ha.keys():
                    x, y = ha.get_tensor(k), open_b[ib[k]].get_tensor(k)
                    same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                    if not same:
                        return {"bit_exact": False, "why": k}
    return {"bit_exact": True, "tensors": len(ia)}


def _drop_page_cache() -> bool:
    """Cold reads, as when converting a 1.5 TB release (needs root; otherwise the cache stays warm)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def _read_all(hf_dir: str) -> None:
    from safetensors import safe_open

    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                h.get_tensor(k)


def run_step(step: str, a: argparse.Namespace) -> dict:
    work = Path(a.workdir)
    if step != "read":  # library import time (torch, megatron-core: a few s) is not conversion time
        from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
        from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
    t0 = time.perf_counter()
    if step == "read":
        _read_all(str(work / "hf"))
    elif step == "copy":
        shutil.copytree(work / "hf", work / "hf_copy")
        os.sync()
    elif step == "hf-to-mcore":
        import glm5_mcore.checkpoint.manifest as manifest

        write, spent = manifest.write_manifest, []

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return write(*args, **kw)
            finally:
                spent.append(time.perf_counter() - t)

        manifest.write_manifest = timed
        hf_to_mcore(work / "hf", work / "mc", workers=a.workers, progress=False)
    elif step == "mcore-to-hf":
        mcore_to_hf(work / "mc", work / "hf_back", max_shard_size=a.shard_mb << 20, progress=False)
    elif step == "mcore-to-hf-noverify":
        os.environ["GLM5_VERIFY_CHECKSUMS"] = "0"
        mcore_to_hf(work / "mc", work / "hf_back2", max_shard_size=a.shard_mb << 20, progress=False)
    elif step == "checksum-verify":
        from glm5_mcore.checkpoint.manifest import verify_tree

        verify_tree(work / "mc")
    elif step == "manifest":
        from glm5_mcore.checkpoint.manifest import write_manifest

        write_manifest(work / "mc" / "iter_0000000")
    elif step == "verify":
        return {"step": step, **_verify(work / "hf", work / "hf_back")}
    if step not in ("read", "checksum-verify"):
        os.sync()  # the bytes are on disk, as for the copy
    dt = time.perf_counter() - t0
    out = {"step": step, "time_s": dt, "peak_rss_bytes": _vm_hwm()}
    if step == "hf-to-mcore":
        out["manifest_s"] = sum(spent)
    return out


def _vm_hwm() -> int:
    """Peak RSS of this process image (``ru_maxrss`` survives exec and would report the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="runs/bench_convert")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--shard-mb", type=int, default=SHARD_BYTES >> 20, help="input and output shard size")
    p.add_argument("--big-layers", action="store_true",
                   help="2 layers + MTP, 160 experts of width 2048: MoE layers 3.75x the 1 GiB shards")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and outputs")
    p.add_argument("--one")
    a = p.parse_args()
    if a.big_layers:
        a.layers, a.experts, a.expert_width = 2, 160, 2048
    if a.one:
        print(json.dumps(run_step(a.one, a)))
        return
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    info = make_checkpoint(work / "hf", a.layers, a.experts, a.expert_width, a.shard_mb << 20)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = {}
    cold = True
    for step in ("read", "copy", "hf-to-mcore", "read", "mcore-to-hf", "mcore-to-hf-noverify", "checksum-verify",
                 "manifest", "verify"):
        cold &= _drop_page_cache()  # every step starts cold, with no dirty pages of the previous one
        r = subprocess.run([sys.executable, __file__, "--one", step, "--workdir", str(work),
                            "--workers", str(a.workers), "--shard-mb", str(a.shard_mb)], env=env,
                           capture_output=True, text=True)
        line = [l for l in r.stdout.splitlines() if l.startswith("{")]
        if r.returncode or not line:
            raise SystemExit(f"{step} failed:\n{r.stderr[-3000:]}")
        got = json.loads(line[-1])
        if step == "read" and step in res:
            res[step]["time_s"] = min(res[step]["time_s"], got["time_s"])
        else:
            res[step] = got
    gb = info["bytes"] / 1e9
    out_shard = max(f.stat().st_size for f in (work / "hf_back").glob("*.safetensors"))
    layer_ratio = info["moe_layer_bytes"] / info["largest_shard"]
    out = {"checkpoint_gb": gb, "shards": info["shards"], "largest_shard_gb": info["largest_shard"] / 1e9,
           "largest_output_shard_gb": out_shard / 1e9, "moe_layer_gb": info["moe_layer_bytes"] / 1e9,
           "layer_vs_shard": layer_ratio, "round_trip_bit_exact": res["verify"]["bit_exact"],
           "workers": a.workers, "cold_cache": cold, "rows": [],
           "targets": {"throughput_ratio_min": 0.5, "rss_ratio_max": 2.0}}
    print(f"synthetic GLM-5 checkpoint: {gb:.2f} GB in {info['shards']} shards (largest "
          f"{info['largest_shard'] / 1e9:.2f} GB); MoE layer {info['moe_layer_bytes'] / 1e9:.2f} GB = "
          f"{layer_ratio:.1f}x the shard; round trip bit-exact: {res['verify']['bit_exact']}")
    print(f"{'step':<12} {'time s':>8} {'GB/s':>7} {'vs read':>8} {'vs copy':>8} {'peak RSS GB':>12} "
          f"{'RSS/shard':>10}")
    ok = True
    for step in ("read", "copy", "hf-to-mcore", "mcore-to-hf"):
        r = res[step]
        ratio = res["read"]["time_s"] / r["time_s"]
        vs_copy = res["copy"]["time_s"] / r["time_s"]
        mem = r["peak_rss_bytes"] / (out_shard if step == "mcore-to-hf" else info["largest_shard"])
        print(f"{step:<12} {r['time_s']:8.2f} {gb / r['time_s']:7.2f} {ratio:7.2f}x {vs_copy:7.2f}x "
              f"{r['peak_rss_bytes'] / 1e9:12.2f} {mem:9.2f}x")
        out["rows"].append({"step": step, "time_s": r["time_s"], "gb_per_s": gb / r["time_s"],
                            "throughput_vs_read": ratio, "throughput_vs_copy": vs_copy,
                            "peak_rss_gb": r["peak_rss_bytes"] / 1e9, "rss_vs_largest_shard": mem})
        if step not in ("read", "copy"):
            ok &= ratio >= 0.5 and mem <= 2.0
    on, off = res["mcore-to-hf"]["time_s"], res["mcore-to-hf-noverify"]["time_s"]
    ver, rehash = res["checksum-verify"]["time_s"], res["manifest"]["time_s"]
    man, h2m = res["hf-to-mcore"]["manifest_s"], res["hf-to-mcore"]["time_s"]
    out["checksum"] = {"mcore_to_hf_verify_s": on, "mcore_to_hf_noverify_s": off,
                       "verify_overhead_ratio": on / off - 1, "verify_only_s": ver, "verify_gb_per_s": gb / ver,
                       "mcore_to_hf_noverify_peak_rss_gb": res["mcore-to-hf-noverify"]["peak_rss_bytes"] / 1e9,
                       "manifest_in_hf_to_mcore_s": man, "manifest_vs_hf_to_mcore": man / h2m,
                       "manifest_rehash_from_disk_s": rehash}
    print(f"checksums: mcore-to-hf {on:.2f} s verified (alongside) vs {off:.2f} s --no-verify "
          f"(+{100 * (on / off - 1):.1f}%); verify alone {ver:.2f} s ({gb / ver:.2f} GB/s cold); manifest in "
          f"hf-to-mcore {man:.2f} s ({100 * man / h2m:.1f}%; hashed back from disk it takes {rehash:.2f} s)")
    out["pass"] = ok and res["verify"]["bit_exact"]
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
