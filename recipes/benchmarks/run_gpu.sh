#!/usr/bin/env bash
# GPU benchmark runs (NOT YET RUN: no GPU session has had device time for them; the CPU results next to this
# script are the measured ones). Usage: bash recipes/benchmarks/run_gpu.sh <results folder>
# With as many GPUs as ranks each rank gets its own GPU and NCCL; with fewer, every rank shares GPU 0 over gloo
# (host-staged point-to-point), which measures memory per rank (capped with set_per_process_memory_fraction)
# but not speed.
set -euo pipefail
out="${1:-results/gpu}"

# 1. 4 GPUs, gpt2-medium, bf16 autocast, 16 x 1024 tokens: speed and memory of every layout against 1-D TP
#    (Zhu & Dong report "2d" at 1.84x the speed of 1-D TP here) and the single-GPU reference against transformers.
tp2d-bench --device cuda --dtype bfloat16 --model gpt2-medium --batch 16 --seq 1024 --p 4 --steps 20 --warmup 5 \
  --layouts single,hf,tp1d,2d,metp,2d-metp --memory-seqs 1024,2048,4096,8192 --out "$out/gpt2_medium_p4"

# 2. 8 GPUs, the longest trainable sequence under 40 GiB per GPU (Liang et al.: METP 2.38-2.99x longer).
tp2d-bench --device cuda --dtype bfloat16 --model gpt2-medium --layouts "" --max-seq-layouts tp1d,metp \
  --max-seq-p 8 --cap-mib 40960 --max-seq-unit 4096 --max-seq-limit 1048576 --out "$out/max_seq_p8"

# 3. Weak scaling over 1, 4, 16 GPUs (batch grows with p).
tp2d-bench --device cuda --dtype bfloat16 --model gpt2-medium --seq 1024 --layouts "" --weak-scaling 1,4,16 \
  --weak-layouts tp1d,2d --weak-batch 2 --steps 20 --warmup 5 --out "$out/weak_scaling"
