#!/usr/bin/env bash
# Qwen3.5-35B-A3B (MoE, native MTP head): TailSieve with MTP, as `tailsieve plan` picks it.
# Layout on one 8-GPU node: 4 vLLM replicas of TP2. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-35b-a3b_verl_mtp.sh (stock verl with MTP on every replica)
# Controller's perf model: table:h200-moe:qwen3-30b-a3b, borrowed: the only bundled MoE table, the same
# ~3B active parameters per token; Qwen3.5-35B-A3B is not measured (`tailsieve calibrate` measures it).
#   bash recipes/qwen3_5-35b-a3b_tailsieve_mtp.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-35b-a3b_tailsieve_mtp.sh      # compose + validate only, no GPU
# Engines: `tailsieve plan` for this layout on its bundled profile (table:h200-moe, one logged step of
# the `real` preset, 512 groups x 8, B = 64 on 4 replicas, MTP-like acceptance 0.85,0.8,0.75 and draft
# cost 1/28; about 30 s on 2 CPU cores):
#   tailsieve plan --workload real --replicas 4 --batch 64 --n 8 --perf-model table:h200-moe --steps 20 --seeds 3 --spec-acceptance 0.85,0.8,0.75
# Its pick is the stock fallback: no TailSieve configuration beats stock verl with MTP k = 6 on every
# replica (verl-spec, predicted 2.15x stock verl). To run the pick:
#   MTP_BULK_TOKENS=6 bash recipes/qwen3_5-35b-a3b_verl_mtp.sh
# This recipe runs the plan's best TailSieve configuration, tailsieve-dynsd: vLLM's documented schedule
# (MTP_SCHEDULE) on every replica, adaptive; the plan's runs ended at one shared pool (q = 0, m = 0), and
# the trainer starts there and adapts; predicted 0.885x the pick (10-90 % band 0.882-0.887x), 1.90x stock
# verl.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-35B-A3B
layout 2 0.6 table:h200-moe:qwen3-30b-a3b
offload_actor
tailsieve_mtp_dynsd 0 0
launch "$@"
