#!/usr/bin/env bash
# One machine, one process per GPU started by torchrun (clusters and containers often expect torchrun; plain
# `tp2d-train` starts the same processes itself). Without GPUs it starts 4 CPU processes (one 2x2 grid).
#   bash recipes/single_node_torchrun.sh                                  # the default run
#   bash recipes/single_node_torchrun.sh model=gpt2-medium trainer.max_steps=1000
# Shows: the run of `tp2d-train` with the same overrides, in outputs/<date>/<time>/ (rank 0 picks the folder; the
# other ranks write their checkpoint shards into it and create nothing else).
set -euo pipefail
NPROC=${NPROC:-$(python -c "import torch; print(torch.cuda.device_count() or 4)")}
exec torchrun --standalone --nproc-per-node="$NPROC" -m lightning_tp2d.train "$@"
