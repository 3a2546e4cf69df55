#!/usr/bin/env bash
# Submit `glm5 rl` to a running Ray cluster (the driver runs on the cluster; trainer and rollout actors
# are placed by Ray). From the repo root, with RAY_ADDRESS pointing at the head's dashboard:
#   RAY_ADDRESS=http://head:8265 launch/ray_job_rl.sh --config glm5_744b model.ckpt=ckpt/glm5 data.train=data/math.jsonl
# The working directory is shipped to the cluster; the nodes need the environment of ./setup.sh
# (plus `pip install -e .[gpu] vllm` for GPU runs).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS=http://<head>:8265}"
exec ray job submit --address "$RAY_ADDRESS" --working-dir . \
  --runtime-env-json '{"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}, "excludes": ["runs/", ".venv/", ".git/"]}' \
  -- python -m recipes.main rl ray.address=auto "$@"
