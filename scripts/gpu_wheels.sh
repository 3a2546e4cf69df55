#!/usr/bin/env bash
# Build .whl/: the Python-3.12 x86-64 wheels a lent GPU machine lacks for bench/gpu_check.py (its image has
# torch 2.11 + CUDA 13, Triton, transformers, peft, safetensors, xxhash, numpy, PyYAML; no registry).
#
#   scripts/gpu_wheels.sh               megatron-core 0.19.2, omegaconf 2.3.0 + antlr4 4.9.3 (built here: sdist only)
#   scripts/gpu_wheels.sh --tilelang    also TileLang + apache-tvm-ffi + torch-c-dlpack-ext (the fused DSA kernels)
#   scripts/gpu_wheels.sh --rl          also verl 0.9.1 + tensordict 0.10.0 and what they import (cloudpickle, orjson,
#                                       pyvers, codetiming, psutil): the rl_step and colocate stages. Not Ray (~70 MB):
#                                       verl's RL math imports without it (rl.train.verl_import)
#   (both flags may be given; docs/gpu.md lists what each carries, with MiB)
#
# Everything a call carries (this repo's tracked files + .whl/) must stay under 64 MiB; z3-solver, a hard
# requirement of TileLang, is ~29 MB and does not fit beside TileLang (~50 MB), so it is left out and the
# env stage reports whether `import tilelang` works without it. Measured 2026-12-01 (pip download
# --python-version 3.12 --only-binary :all: --no-deps): megatron-core 2.37 MB, omegaconf 0.08, antlr4 0.14,
# tilelang 0.1.15 49.55, apache-tvm-ffi 0.1.12 2.72, torch-c-dlpack-ext 0.1.5 0.90, z3-solver 4.15.4 29.27;
# 2026-12-02: verl 0.9.1 1.69, tensordict 0.10.0 0.45, psutil 7.2.2 0.16, orjson 3.13.0 0.13, cloudpickle 3.1.3 0.02,
# pyvers 0.2.3 0.01, codetiming 1.4.0 0.01 (2.47 MB for --rl).
# Never deletes anything it did not make: refuses a .whl/ that holds files it did not write.
#
# On the machine: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#                   --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
LIMIT=$((64 * 1024 * 1024))
WANT=("megatron-core==0.19.2" "omegaconf==2.3.0")
for arg in "$@"; do
  case "$arg" in
    --tilelang) WANT+=("tilelang==0.1.15" "apache-tvm-ffi>=0.1.11,<0.1.13" "torch-c-dlpack-ext==0.1.5") ;;
    --rl) WANT+=("verl==0.9.1" "tensordict==0.10.0" "cloudpickle==3.1.3" "orjson==3.13.0" "pyvers==0.2.3"
                 "codetiming==1.4.0" "psutil==7.2.2") ;;
    *) echo "gpu_wheels.sh: unknown argument $arg (--tilelang, --rl)" >&2; exit 2 ;;
  esac
done
if [[ -d $OUT ]] && [[ -n "$(ls -A $OUT)" ]] && [[ ! -f $OUT/.gpu_wheels ]]; then
  echo "gpu_wheels.sh: $OUT/ holds files this script did not write; move them away first" >&2; exit 1
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in "${WANT[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$TMP" "$pkg"
done
"$PY" -m pip wheel -q --no-deps -w "$TMP" antlr4-python3-runtime==4.9.3   # pure Python, sdist only on PyPI
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -cb "$TMP"/*.whl | tail -1 | cut -f1)
if (( tracked + wheels > LIMIT )); then
  echo "gpu_wheels.sh: repo $((tracked / 1024)) KiB + wheels $((wheels / 1024)) KiB exceed 64 MiB" >&2; exit 1
fi
mkdir -p $OUT
rm -f $OUT/*.whl
mv "$TMP"/*.whl $OUT/
touch $OUT/.gpu_wheels
"$PY" - "$OUT" "$tracked" <<'EOF'
import json, os, sys
out, tracked = sys.argv[1], int(sys.argv[2])
sizes = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.endswith(".whl")}
total = sum(sizes.values()) + tracked
print(json.dumps({"wheels_mb": {k: round(v / 1e6, 2) for k, v in sizes.items()}, "repo_mb": round(tracked / 1e6, 2),
                  "carried_mib": round(total / 2 ** 20, 1), "limit_mib": 64, "fits": total <= 64 * 2 ** 20}))
EOF
