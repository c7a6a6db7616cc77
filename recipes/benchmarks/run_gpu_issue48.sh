#!/usr/bin/env bash
# Issue 48's prepared GPU run (NOT YET RUN: no session since 2026-12-04 has had a GPU): one GPU, about 4 minutes on an
# H100 / H200, the most important part first, each part bounded so a slow one cannot take the others' time.
# Usage: bash recipes/benchmarks/run_gpu_issue48.sh <results folder>   (on the device machine: "$OUT")
#   1. rates: bf16 GEMMs at the planner's shapes and GPT-2's LM head as it is and padded (pad_vocab_multiple=128),
#      float8 (_scaled_mm, tensorwise) beside them, causal SDPA, the METP ring's fused attention blocks, the copy
#      bandwidth (recipes/gpu_rates.py);
#   2. the layouts' one-rank step, eager and profiled, GPT-2 medium B8 x 1024 and Llama 3.2 1B B2 x 2048: tokens/s
#      against the plain model, host and GPU seconds, aten ops per step and host seconds per op (what
#      lightning_tp2d/planning/host_cost.py's SECONDS_PER_OP takes), and no host sync inside a step;
#   3. the same compiled (inductor), GPT-2 medium: tokens/s and graph breaks.
# Then: copy the JSON into recipes/results/, set host_cost.SECONDS_PER_OP / PLAIN_SECONDS_PER_OP from part 2's
# host_s_per_aten_op, and regenerate the scale tables (python recipes/benchmarks/scale.py).
set -uo pipefail
out="${1:-results/gpu_issue48}"
mkdir -p "$out"
timeout 60 python recipes/gpu_rates.py --out "$out/gpu_rates.json" || echo "rates: exit $?"
timeout 100 python recipes/gpu_issue12.py --parts layer_overhead,no_host_syncs --profile \
  --out "$out/layer_overhead_eager.json" || echo "eager: exit $?"
timeout 100 python recipes/gpu_issue12.py --parts layer_overhead --compile --models gpt2-medium:8x1024 \
  --out "$out/layer_overhead_compiled.json" || echo "compiled: exit $?"
