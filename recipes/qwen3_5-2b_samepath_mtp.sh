#!/usr/bin/env bash
# Qwen3.5-2B (dense, native MTP head): stock verl's per-sample least-loaded routing through the plugin's code path
# (+tailsieve.enable=false, (q, m) = (0, 0)) with MTP at the bulk depth on every replica: the same-path control of the MTP variants.
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-2b_verl_mtp.sh (stock verl with MTP on every replica)
#   bash recipes/qwen3_5-2b_samepath_mtp.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-2b_samepath_mtp.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-2B
layout 1 0.6 table:h200-dense:qwen3-1.7b
same_path_mtp
launch "$@"
