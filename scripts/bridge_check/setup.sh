#!/bin/bash
# Side environment for the manual Megatron-Bridge round trip (bridge_side.py): Megatron-Bridge 0.6.2 and the few
# packages it needs at import that the project venv lacks, installed with --target into $BRIDGE_SIDE (default
# /tmp/glm5-bridge-side), never into .venv. Bridge declares Python 3.12 + Transformer Engine + CUDA; on this
# CPU machine it runs on the venv's Python 3.11 / torch / Megatron-Core with TE's import stubbed (bridge_env.py).
set -euo pipefail
S=${BRIDGE_SIDE:-/tmp/glm5-bridge-side}
mkdir -p "$S/dl"
python3.11 -m pip download -q megatron-bridge==0.6.2 --no-deps --python-version 3.12 --only-binary=:all: -d "$S/dl"
rm -rf "$S/site" && mkdir -p "$S/site" && (cd "$S/site" && unzip -q -o "$S"/dl/megatron_bridge-0.6.2-py3-none-any.whl)
python3.11 -m pip install -q --no-deps --target "$S/pkgs" transformers==5.12.1 nvidia-modelopt pulp scipy tensorboard absl-py
# transformers 5.12.1 pins tokenizers <= 0.23.0 and huggingface-hub < 2; the venv's newer ones work for this use
sed -i -e 's/"tokenizers>=0.22.0,<=0.23.0"/"tokenizers>=0.22.0"/' -e 's/"huggingface-hub>=1.5.0,<2.0"/"huggingface-hub>=1.5.0"/' \
    "$S/pkgs/transformers/dependency_versions_table.py"
echo "side environment ready: $S"
