#!/usr/bin/env bash
# Qwen3-4B (dense): TailSieve with a DFlash drafter on the tail route (needs DFLASH_DRAFT_PATH).
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3-4b_verl.sh (no drafter: verl has no stock DFlash recipe)
# Controller's perf model: table:h200-dense:qwen3-4b, this model's own rows of the bundled H200 table.
#   bash recipes/qwen3-4b_tailsieve_dflash.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3-4b_tailsieve_dflash.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3-4B
layout 1 0.6 table:h200-dense:qwen3-4b
tailsieve_dflash_tail
launch "$@"
