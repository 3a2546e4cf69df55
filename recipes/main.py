"""The ``glm5`` console command: ``glm5 tiny``, ``glm5 parity``, ``glm5 convert``, ``glm5 lora``,
``glm5 checkpoint verify``, ``glm5 data preprocess``, ``glm5 plot``."""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm5", description="GLM-5 on Megatron-Core")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("sft", help="SFT / continued pretraining (a Hydra app: glm5 sft --help | --cfg job | key=value ...)")
    sub.add_parser("rl", help="GRPO / PPO with Ray (a Hydra app: glm5 rl [--config NAME] --help | key=value ...)")

    t = sub.add_parser("tiny", help="write a tiny random GLM-5 HF checkpoint")
    t.add_argument("--out", required=True)
    t.add_argument("--mtp", action="store_true", help="add the MTP layer model.layers.{L}.*")
    t.add_argument("--index-share", action="store_true", help="layer 2 reuses layer 1's top-k")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--vocab-size", type=int, default=128,
                   help="vocabulary (129: one TP 2 does not divide, padded as Megatron pads it)")
    t.add_argument("--fp8-block", type=int, metavar="B",
                   help="store the projections as an FP8 release does: e4m3 + BxB block scales (the release: 128)")

    q = sub.add_parser("parity", help="compare our Megatron-Core model with transformers")
    q.add_argument("--hf-dir", help="HF folder (weights for the reference; our weights unless --ckpt)")
    q.add_argument("--ckpt", help="a glm5-mcore or Megatron-LM / Megatron-Bridge checkpoint folder: "
                   "our model loads it (latest iteration)")
    q.add_argument("--adapter", help="HF PEFT adapter folder: ours imports it, the reference loads it with peft")
    q.add_argument("--input-ids", help="safetensors file with int64 input_ids [B, S]")
    q.add_argument("--save-logits", help="write Megatron logits (safetensors, key 'logits')")
    q.add_argument("--tp", type=int, default=1)
    q.add_argument("--ep", type=int, default=1)
    q.add_argument("--cp", type=int, default=1)
    q.add_argument("--make-vocab-size-divisible-by", type=int, default=1,
                   help="pad the vocabulary to a multiple of this x tp (Megatron-LM's flag; a training run's "
                        "parallel.make_vocab_size_divisible_by)")
    q.add_argument("--atol", type=float, default=1e-4)
    q.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    q.add_argument("--batch", type=int, default=2, help="random input batch size")
    q.add_argument("--seq-len", type=int, default=32, help="random input length")
    q.add_argument("--seed", type=int, default=0)

    c = sub.add_parser("convert", help="HF safetensors <-> Megatron-Core checkpoint")
    csub = c.add_subparsers(dest="direction", required=True)
    h = csub.add_parser("hf-to-mcore", help="HF folder -> DIR/iter_0000000/model + DIR/hf + DIR/latest")
    h.add_argument("--hf-dir", required=True)
    h.add_argument("--out", required=True)
    h.add_argument("--workers", type=int, default=1, help="writer threads (one file each)")
    h.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: the HF config's dtype")
    h.add_argument("--dequantize-fp8", action="store_true",
                   help="an FP8 release's e4m3 weights dequantized into --dtype (default: kept as stored, "
                        "bytes + block scales, for model.base_dtype=fp8)")
    m = csub.add_parser("mcore-to-hf", help="checkpoint folder -> HF folder (on-disk layout, MTP included)")
    m.add_argument("--ckpt", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--max-shard-size", default="5GB")
    m.add_argument("--iteration", type=int, help="default: DIR/latest")
    m.add_argument("--dtype", choices=["bf16", "fp32", "fp16", "fp8"],
                   help="default: each tensor as its HF origin stored it; fp8: the release's 128x128 block format")
    pl = sub.add_parser("plan", help="memory and layout planner: every kind of rank sized against a cluster")
    from recipes.plan_cli import add_arguments as add_plan_arguments

    add_plan_arguments(pl)
    lo = sub.add_parser("lora", help="LoRA adapters")
    losub = lo.add_subparsers(dest="action", required=True)
    ex = losub.add_parser("export", help="checkpoint adapter -> HF PEFT folder (or merged HF checkpoint)")
    ex.add_argument("--ckpt", required=True)
    ex.add_argument("--adapter", default="default")
    ex.add_argument("--iteration", type=int, help="default: DIR/latest")
    ex.add_argument("--out", required=True)
    ex.add_argument("--merged", action="store_true", help="full HF checkpoint with the adapter merged")
    ex.add_argument("--max-shard-size", default="5GB")
    ex.add_argument("--base", help="with --merged: the base weights to merge onto, a checkpoint or HF folder "
                                   "(default: what the run records: its base checkpoint or HF origin; a "
                                   "Megatron-Bridge PEFT checkpoint's run_config.yaml checkpoint.pretrained_checkpoint)")
    ex.add_argument("--allow-other-base", action="store_true",
                    help="with --base: merge onto weights other than the HF origin the run recorded (refused "
                         "otherwise: the adapter was not trained on them)")
    da = sub.add_parser("data", help="datasets")
    dasub = da.add_subparsers(dest="action", required=True)
    pre = dasub.add_parser("preprocess", help="jsonl -> Megatron-Core indexed dataset folder (tokens + loss mask)")
    pre.add_argument("--input", nargs="+", required=True, help="jsonl files (concatenated in order)")
    pre.add_argument("--out", required=True, help="output folder (prefix OUT/tokens)")
    pre.add_argument("--hf-dir", required=True, help="HF folder with the tokenizer (and chat template)")
    pre.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    pre.add_argument("--max-tokens", type=int, help="truncate documents to this many training positions")
    pre.add_argument("--skip-bad-rows", action="store_true", help="skip and count bad rows instead of stopping")
    pre.add_argument("--chunk-mb", type=float, default=8.0, help="input bytes per work item")
    for x in (h, m, ex, pre):
        x.add_argument("--no-progress", action="store_true")
        x.add_argument("--allow-nonfinite", action="store_true", help="convert NaN/Inf weights instead of refusing")
    for x in (t, h, m, ex, q):
        x.add_argument("--overwrite", action="store_true",
                       help="replace an existing output that is not a previous output of this command")
    for x in (h, m, ex, q):
        x.add_argument("--no-verify", action="store_true", help="skip checksum verification of the inputs")
    pt = sub.add_parser("plot", help="PNG charts of runs' metrics.jsonl (SFT and RL panels, runs overlaid)")
    pt.add_argument("runs", nargs="+", metavar="RUN_DIR", help="sft train.out / rl trainer.out folders")
    pt.add_argument("--out", default="metrics.png", help="the PNG to write (default: ./metrics.png)")
    pt.add_argument("--overwrite", action="store_true",
                    help="replace an existing file that is not a previous output of glm5 plot")
    ck = sub.add_parser("checkpoint", help="checkpoint folders")
    cksub = ck.add_subparsers(dest="action", required=True)
    v = cksub.add_parser("verify", help="check every file of a folder against its checksum manifest(s)")
    v.add_argument("dir")
    xp = cksub.add_parser("export", help="a checkpoint in another tool's layout (Megatron-LM / Megatron-Bridge)")
    xp.add_argument("--format", choices=["megatron"], required=True)
    xp.add_argument("--ckpt", required=True)
    xp.add_argument("--iteration", type=int, help="default: DIR/latest")
    xp.add_argument("--out", required=True)
    xp.add_argument("--merge-adapter", metavar="NAME", help="export the base weights with this LoRA adapter merged")
    xp.add_argument("--overwrite", action="store_true",
                    help="replace an existing output that is not a previous output of this command")
    xp.add_argument("--no-verify", action="store_true", help="skip checksum verification of the inputs")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("sft", "rl"):  # Hydra apps (recipes.hydra_app): glm5 sft|rl [flags] key=value ...
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        try:
            from recipes import cli as recipes_cli

            return (recipes_cli.sft_main if argv[0] == "sft" else recipes_cli.rl_main)(argv[1:])
        except (ValueError, FileNotFoundError, KeyError) as e:
            print(f"glm5 {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    args = _parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if getattr(args, "no_verify", False):
        os.environ["GLM5_VERIFY_CHECKSUMS"] = "0"
    try:
        if args.cmd == "tiny":
            from glm5_mcore.tiny import write_tiny

            out = write_tiny(args.out, mtp=args.mtp, index_share=args.index_share, seed=args.seed,
                             overwrite=args.overwrite, vocab_size=args.vocab_size, fp8_block=args.fp8_block)
            print(f"wrote tiny GLM-5 checkpoint to {out}")
            return 0
        if args.cmd == "convert":
            from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
            from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

            if args.direction == "hf-to-mcore":
                out = hf_to_mcore(args.hf_dir, args.out, args.workers, args.dtype,
                                  progress=not args.no_progress, overwrite=args.overwrite,
                                  allow_nonfinite=args.allow_nonfinite, dequantize_fp8=args.dequantize_fp8)
            else:
                out = mcore_to_hf(args.ckpt, args.out, args.max_shard_size, args.iteration,
                                  progress=not args.no_progress, overwrite=args.overwrite,
                                  allow_nonfinite=args.allow_nonfinite, dtype=args.dtype)
            print(f"wrote {out}")
            return 0
        if args.cmd == "lora":
            from glm5_mcore.convert.lora_export import export_checkpoint_adapter

            out = export_checkpoint_adapter(args.ckpt, args.out, args.adapter, args.iteration, args.merged,
                                            args.max_shard_size, progress=not args.no_progress,
                                            overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite,
                                            base=args.base, allow_other_base=args.allow_other_base)
            print(f"wrote {out}")
            return 0
        if args.cmd == "checkpoint" and args.action == "export":
            from glm5_mcore.convert.megatron_export import export_megatron

            out = export_megatron(args.ckpt, args.out, args.iteration, args.overwrite, args.merge_adapter)
            print(f"wrote {out}")
            return 0
        if args.cmd == "checkpoint":
            from glm5_mcore.checkpoint.layout import verify_checkpoint

            for folder, n in verify_checkpoint(args.dir):
                print(f"{folder}: {n} files ok")
            return 0
        if args.cmd == "plan":
            from recipes.plan_cli import run as plan_run

            return plan_run(args)
        if args.cmd == "data":
            import json

            from glm5_mcore.data.preprocess import preprocess

            out = preprocess(args.input, args.out, args.hf_dir, args.workers, args.max_tokens, args.skip_bad_rows,
                             args.chunk_mb, progress=not args.no_progress)
            print(json.dumps({k: v for k, v in out.items() if k != "errors"} | {"errors": out["errors"][:3]}))
            return 0
        if args.cmd == "plot":
            from glm5_mcore.plot import plot

            titles = plot(args.runs, args.out, args.overwrite)
            print(f"wrote {args.out} (panels: {'; '.join(titles)})")
            return 0
        if args.cmd == "parity":
            from glm5_mcore.parity import main as parity_main

            return parity_main(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"glm5 {args.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"glm5 {args.cmd}: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    return 1


def _one_line(e: BaseException) -> str:
    """The error text (a KeyError's repr quotes drop), on one line."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(text).split())


if __name__ == "__main__":
    sys.exit(main())
