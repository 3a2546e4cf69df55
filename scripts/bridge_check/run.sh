#!/bin/bash
# Manual round trip through Megatron-Bridge 0.6.2 itself (not CI: Bridge wants Python 3.12, TE and CUDA; here
# it runs on CPU with the shims of bridge_env.py / bridge_side.py). Run setup.sh once first.
#   1. ours -> `glm5 checkpoint export --format megatron` -> Bridge export_ckpt -> HF, vs the source
#   2. Bridge import_ckpt -> its Megatron folder -> our `glm5 convert mcore-to-hf` + `glm5 parity --ckpt`
#   3. Bridge's LoRA + its PEFT save -> our `glm5 lora export` (+ --merged), vs its adapter params and its HF export
#   4. the same with Bridge's CanonicalLoRA (fc1 gate / up with their own adapters): weight deltas vs its params
# Ends with one JSON line of figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
S=${BRIDGE_SIDE:-/tmp/glm5-bridge-side}
W=${1:-$(mktemp -d /tmp/glm5-bridge-check.XXXX)}
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
G=".venv/bin/glm5"
side() { env PYTHONPATH="$PWD/scripts/bridge_check:$PWD:$S/site:$S/pkgs" timeout 900 .venv/bin/python -W ignore \
         scripts/bridge_check/bridge_side.py "$@" 2>"$W/bridge_$1.log" | tail -1; }
$G tiny --out "$W/tiny" --mtp >/dev/null
$G convert hf-to-mcore --hf-dir "$W/tiny" --out "$W/ours" --no-progress 2>/dev/null
$G checkpoint export --format megatron --ckpt "$W/ours" --out "$W/meg" 2>/dev/null
side export "$W/tiny" "$W/meg" "$W/bridge_hf"
side import "$W/tiny" "$W/bridge_meg"
$G convert mcore-to-hf --ckpt "$W/bridge_meg" --out "$W/ours_from_bridge" --no-progress 2>/dev/null
$G parity --ckpt "$W/bridge_meg" --hf-dir "$W/tiny" 2>/dev/null | tail -1
side peft "$W/tiny" "$W/bridge_meg" "$W/bridge_lora"
$G lora export --ckpt "$W/bridge_lora" --out "$W/ours_peft" 2>/dev/null
$G lora export --ckpt "$W/bridge_lora" --merged --out "$W/ours_merged" --no-progress 2>/dev/null
BRIDGE_PEFT=canonical side peft "$W/tiny" "$W/bridge_meg" "$W/bridge_clora"
$G lora export --ckpt "$W/bridge_clora" --out "$W/ours_cpeft" 2>/dev/null
$G lora export --ckpt "$W/bridge_clora" --merged --out "$W/ours_cmerged" --no-progress 2>/dev/null
.venv/bin/python -W ignore scripts/bridge_check/compare.py "$W" 2>/dev/null | tail -1
