#!/usr/bin/env bash
# Several machines with torchrun. Run the same command on every machine, each with its own NODE_RANK and all with
# machine 0's address; the repository (and outputs/) must be on a shared filesystem, since every rank writes its
# checkpoint shards into rank 0's run directory.
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 NNODES=2 bash recipes/multi_node_torchrun.sh        # on machine 0
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 NNODES=2 bash recipes/multi_node_torchrun.sh        # on machine 1
# Extra arguments are tp2d-train overrides (e.g. experiment=weak_scaling_16gpu). trainer=multinode takes the GPUs per
# machine and the machine count from torchrun. With the default layout, each 2x2 grid stays inside one machine
# (tensor_parallel_size auto divides the GPUs of one machine) and data parallelism spans the machines.
# Shows: one run directory outputs/<date>/<time>/ on machine 0's side of the shared filesystem.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to machine 0's address}" "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-$(python -c "import torch; print(torch.cuda.device_count() or 4)")}
exec torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC" \
    --master-addr="$MASTER_ADDR" --master-port="${MASTER_PORT:-29500}" \
    -m lightning_tp2d.train trainer=multinode "$@"
