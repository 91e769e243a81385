#!/usr/bin/env bash
# Qwen3.5-35B-A3B (MoE, native MTP head): stock verl's per-sample least-loaded routing run through the plugin's code path
# (+tailsieve.enable=false, (q, m) = (0, 0)): a same-path control that isolates the plugin's overhead, not the A/B baseline.
# Layout on one 8-GPU node: 4 vLLM replicas of TP2. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-35b-a3b_verl.sh
#   bash recipes/qwen3_5-35b-a3b_samepath.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-35b-a3b_samepath.sh      # compose + validate only, no GPU
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-35B-A3B
layout 2 0.6 table:h200-moe:qwen3-30b-a3b
offload_actor
same_path
launch "$@"
