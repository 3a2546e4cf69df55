#!/usr/bin/env bash
# glm5 sft under torchrun, one node or many. Everything after the script name is a Hydra override:
#   NPROC=8 launch/torchrun_sft.sh model.ckpt=ckpt/glm5 data.train=data/train.jsonl parallel.tp=8
# Multi-node: set NNODES, NODE_RANK and MASTER_ADDR (and MASTER_PORT) on every node.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))" 2>/dev/null || echo 1)}
NNODES=${NNODES:-1}
if [ "$NNODES" -gt 1 ]; then
  RDZV=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --master_addr "${MASTER_ADDR:?set MASTER_ADDR}"
        --master_port "${MASTER_PORT:-29500}")
else
  RDZV=(--standalone)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun "${RDZV[@]}" --nproc_per_node "$NPROC" -m recipes.main sft "$@"
