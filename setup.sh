#!/usr/bin/env bash
# Create .venv with everything the project and its tests need (CPU). Idempotent.
# megatron-core 0.19.2 declares Python >= 3.12 but builds and runs on 3.11, hence the --no-deps step;
# torch is pinned first so pip takes the local CPU wheel instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
# The code tool's sandbox (rl/tasks/sandbox.py) runs on bubblewrap; as root, install it where it is missing
# (not root: the code tool is refused before Ray, naming what is missing).
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; } \
    || echo "setup.sh: could not install bubblewrap (apt-get); the code tool will be refused" >&2
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP numpy "packaging>=24.2" einops
.venv/bin/python -c "import megatron.core" 2>/dev/null || \
  $PIP --no-deps --ignore-requires-python megatron-core==0.19.2
$PIP -e ".[test]"
# verl 0.9.1 pins transformers<5.11, but GLM-5's reference indexer needs >=5.13; its algorithm modules
# (core_algos, rollout_corr_helper) need neither, so it goes in without its dependency pins.
.venv/bin/python -c "import verl" 2>/dev/null || $PIP --no-deps verl==0.9.1
