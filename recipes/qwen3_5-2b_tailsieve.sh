#!/usr/bin/env bash
# Qwen3.5-2B (dense, native MTP head): TailSieve routing-only, adaptive (q, m) from one shared pool.
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-2b_verl.sh
# Controller's perf model: table:h200-dense:qwen3-1.7b, borrowed: no Qwen3.5 model is measured, and
# Qwen3-1.7B is the bundled dense H200 table's nearest size (measure yours: `tailsieve calibrate`).
#   bash recipes/qwen3_5-2b_tailsieve.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-2b_tailsieve.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-2B
layout 1 0.6 table:h200-dense:qwen3-1.7b
tailsieve_adaptive
launch "$@"
