#!/usr/bin/env bash
# torchrun across machines with commsched: run the same command on every node. MASTER_ADDR
# is one node's address, reachable from every node (torchrun's c10d rendezvous runs there
# and numbers the nodes).
#
#   NNODES=2 MASTER_ADDR=10.0.0.1 bash multinode.sh train.py --lr 3e-4      # on each node
#
# torchrun sets LOCAL_WORLD_SIZE, from which commsched knows the ranks per node (the
# hierarchical decompositions, COMMSCHED_DECOMPOSE=hier|leader|auto, use it). Every
# COMMSCHED_* variable must be the same on every node: the ranks check that they agree
# before their first collective.
set -euo pipefail
: "${NNODES:?number of nodes}"
: "${MASTER_ADDR:?node 0's address}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")}
export COMMSCHED=${COMMSCHED:-1}

exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    -m commsched.run "$@"
