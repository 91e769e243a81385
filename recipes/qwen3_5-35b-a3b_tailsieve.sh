#!/usr/bin/env bash
# Qwen3.5-35B-A3B (MoE, native MTP head): TailSieve routing-only, adaptive (q, m) from one shared pool.
# Layout on one 8-GPU node: 4 vLLM replicas of TP2. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-35b-a3b_verl.sh
# Controller's perf model: table:h200-moe:qwen3-30b-a3b, borrowed: the only bundled MoE table, the same
# ~3B active parameters per token; Qwen3.5-35B-A3B is not measured (`tailsieve calibrate` measures it).
#   bash recipes/qwen3_5-35b-a3b_tailsieve.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-35b-a3b_tailsieve.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-35B-A3B
layout 2 0.6 table:h200-moe:qwen3-30b-a3b
offload_actor
tailsieve_adaptive
launch "$@"
