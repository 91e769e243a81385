#!/usr/bin/env bash
# Qwen3.5-35B-A3B (MoE, native MTP head): stock verl with MTP on vLLM's batch-size schedule (dynamic SD, MTP_SCHEDULE) on every replica, verl's own routing (the dynamic-SD stock baseline beside All-MTP).
# Layout on one 8-GPU node: 4 vLLM replicas of TP2. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-35b-a3b_verl.sh (no speculation)
#   bash recipes/qwen3_5-35b-a3b_verl_dynsd.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-35b-a3b_verl_dynsd.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-35B-A3B
layout 2 0.6 table:h200-moe:qwen3-30b-a3b
offload_actor
stock_verl_dynsd
launch "$@"
