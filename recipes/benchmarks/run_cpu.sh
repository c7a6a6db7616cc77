#!/usr/bin/env bash
# The CPU benchmark runs whose results are committed next to this script (gloo, one thread per rank).
# Each writes results.json, results.md and plots into its own folder. About 70 minutes on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

# 1. GPT-2 small (124M: 12 layers, h 768, 12 heads, vocab 50257) at p = 4: every layout side by side with 1-D TP
#    and transformers' GPT2LMHeadModel; memory against sequence length; cost model vs this machine.
tp2d-bench --model gpt2 --batch 4 --seq 256 --p 4 --steps 3 --warmup 1 \
  --layouts single,hf,tp1d,2d,metp,2d-metp --memory-seqs 128,256,512 --model-check \
  --out "$here/gpt2_p4"

# 2. Longest trainable sequence at p = 8 under a 128 MiB per-rank cap (batch 1): METP against 1-D TP.
tp2d-bench --model gpt2 --set n_layer=2 --set n_embd=256 --set n_head=8 --layouts "" \
  --max-seq-layouts tp1d,metp --max-seq-p 8 --cap-mib 128 --max-seq-unit 512 --out "$here/max_seq_p8"
#    The same with a 257-token vocabulary and a 64 MiB cap: activations alone, without the vocabulary's weight,
#    logits and (1-D TP) the full [V, h] embedding gradient torch computes on every rank.
tp2d-bench --model gpt2 --set n_layer=2 --set n_embd=256 --set n_head=8 --set vocab_size=257 --layouts "" \
  --max-seq-layouts tp1d,metp --max-seq-p 8 --cap-mib 64 --max-seq-unit 512 --out "$here/max_seq_p8_small_vocab"

# 3. Weak scaling p = 1, 4, 9, 16 (batch = p sequences of 288): communication per rank of "2d" and 1-D TP.
#    144 heads of width 4 so that every p divides the heads; 16 ranks share 2 cores, so times are not speeds.
tp2d-bench --model gpt2 --set n_layer=2 --set n_embd=576 --set n_head=144 --set vocab_size=257 --seq 288 \
  --layouts "" --weak-scaling 1,4,9,16 --weak-layouts tp1d,2d,metp --weak-batch 1 --steps 2 --warmup 1 \
  --out "$here/weak_scaling"

# 4. SUMMA v2 (issue 11): "2d" (collective SUMMA) beside 1-D TP with and without sequence parallelism on GPT-2 small,
#    p = 4: bytes per rank and calls per block as counted; the projection with the SUMMA variants and fair rows.
tp2d-bench --model gpt2 --batch 4 --seq 256 --p 4 --steps 2 --warmup 1 --layouts tp1d,tp1d-sp,2d \
  --out "$here/summa_v2"
#    This machine's GEMM table (--measured-rates) and the projection priced with it.
tp2d-bench --layouts "" --measured-rates --out "$here/cpu_rates"

# 5. Activation checkpointing (issue 12): GPT-2 small at p = 4, "2d" with none / selective / full beside 1-D TP.
for mode in none selective full; do
  layouts=2d; [ "$mode" = none ] && layouts=tp1d,2d
  tp2d-bench --model gpt2 --batch 4 --seq 256 --p 4 --steps 3 --warmup 1 --layouts "$layouts" \
    --activation-checkpointing "$mode" --projection-gpus 4 --out "$here/activation_checkpointing/$mode"
done

# 6. ZeRO stages 0-3 (issue 23): per-rank parameter, gradient, optimizer and peak bytes and bytes sent at dp 2 and 4,
#    the deepest GPT-2 (width 384) under 64 MiB per rank for each stage, and tp2d-train at stage 3 on 8 processes
#    (trains, checkpoints, resumes).
python "$here/zero_stages.py" --out "$here/zero"
