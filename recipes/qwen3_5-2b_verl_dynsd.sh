#!/usr/bin/env bash
# Qwen3.5-2B (dense, native MTP head): stock verl with MTP on vLLM's batch-size schedule (dynamic SD, MTP_SCHEDULE) on every replica, verl's own routing (the dynamic-SD stock baseline beside All-MTP).
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-2b_verl.sh (no speculation)
#   bash recipes/qwen3_5-2b_verl_dynsd.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-2b_verl_dynsd.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-2B
layout 1 0.6 table:h200-dense:qwen3-1.7b
stock_verl_dynsd
launch "$@"
