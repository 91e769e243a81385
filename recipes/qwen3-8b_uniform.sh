#!/usr/bin/env bash
# Qwen3-8B (dense): uniform routing on TailSieve's code path (second baseline; +tailsieve.group_atomic=true for group routing).
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
#   bash recipes/qwen3-8b_uniform.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3-8b_uniform.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3-8B
layout 1 0.6 table:h200-dense
uniform
launch "$@"
