#!/usr/bin/env bash
# Qwen3-30B-A3B (MoE): stock verl, the A/B baseline every other recipe of this model
# compares with: verl's own sync trainer and per-sample least-loaded router.
# Layout on one 8-GPU node: 4 vLLM replicas of TP2. Dr. GRPO, n = 8; see recipes/README.md.
#   bash recipes/qwen3-30b-a3b_verl.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3-30b-a3b_verl.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3-30B-A3B
layout 2 0.6 table:h200-moe:qwen3-30b-a3b
offload_actor
stock_verl
launch "$@"
