#!/usr/bin/env bash
# Launch `megaprm train` with torchrun, on one node or several.
#
#   one node, 8 GPUs:   scripts/train.sh configs/prof_grpo.yaml [overrides...]
#   several nodes:      NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
#                         scripts/train.sh configs/prof_grpo.yaml trainer.run_dir=runs/x
#                       (run the same command on every node with its own NODE_RANK)
#   CPU, 2 processes:   NPROC_PER_NODE=2 scripts/train.sh configs/prof_grpo_tiny.yaml
#
# The world size is NNODES * NPROC_PER_NODE; it must be a multiple of tp*pp in the config.
set -euo pipefail
config=${1:?usage: scripts/train.sh CONFIG.yaml [section.key=value ...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
[ -x "$py" ] || py=python3
nproc=${NPROC_PER_NODE:-$($py -c "import torch; print(max(torch.cuda.device_count(), 1))")}
nnodes=${NNODES:-1}
if [ "$nnodes" -gt 1 ]; then
  rdzv=(--nnodes="$nnodes" --node-rank="${NODE_RANK:?set NODE_RANK}"
        --master-addr="${MASTER_ADDR:?set MASTER_ADDR}" --master-port="${MASTER_PORT:-29500}")
else
  rdzv=(--standalone --nnodes=1)
fi
exec "$py" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node="$nproc" \
  -m megaprm.cli train --config "$config" "$@"
