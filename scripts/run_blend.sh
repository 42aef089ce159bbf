#!/usr/bin/env bash
# blend recipe (configs/blend.yaml): one node by default; NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT
# for several (see scripts/train.sh). Extra arguments are config overrides.
exec "$(dirname "$0")/train.sh" "$(dirname "$0")/../configs/blend.yaml" "$@"
