#!/usr/bin/env bash
# Qwen3-8B (dense): stock verl, the A/B baseline every other recipe of this model
# compares with: verl's own sync trainer and per-sample least-loaded router.
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
#   bash recipes/qwen3-8b_verl.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3-8b_verl.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3-8B
layout 1 0.6 table:h200-dense:qwen3-8b
stock_verl
launch "$@"
