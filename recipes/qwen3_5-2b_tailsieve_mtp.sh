#!/usr/bin/env bash
# Qwen3.5-2B (dense, native MTP head): TailSieve with MTP per pool, as `tailsieve plan` picks it.
# Layout on one 8-GPU node: 8 vLLM replicas of TP1. Dr. GRPO, n = 8; see recipes/README.md.
# Compare with the stock-verl baseline: recipes/qwen3_5-2b_verl_mtp.sh (stock verl with MTP on every replica)
# Controller's perf model: table:h200-dense:qwen3-1.7b, borrowed: no Qwen3.5 model is measured, and
# Qwen3-1.7B is the bundled dense H200 table's nearest size (measure yours: `tailsieve calibrate`).
#   bash recipes/qwen3_5-2b_tailsieve_mtp.sh [extra Hydra overrides]
#   TAILSIEVE_DRY_RUN=1 bash recipes/qwen3_5-2b_tailsieve_mtp.sh      # compose + validate only, no GPU
# Engines: `tailsieve plan` for this layout on its bundled profile (table:h200-dense, one logged step of
# the `real` preset, 512 groups x 8, B = 64 on 8 replicas, verl 0.9.1's rollout defaults for Qwen3-1.7B
# (the plan's --engine-defaults auto), MTP-like acceptance 0.85,0.8,0.75 and draft cost 1/28; as of
# 69e551d; a few minutes on 2 CPU cores):
#   tailsieve plan --workload real --replicas 8 --batch 64 --n 8 --perf-model table:h200-dense --steps 20 --seeds 3 --spec-acceptance 0.85,0.8,0.75
# Its pick is the stock fallback: no TailSieve configuration beats stock verl with MTP on the batch-size
# schedule 1-32:6,33-64:1,65-256:0 (verl-dynsd-best, predicted 2.86x stock verl). To run the pick:
#   MTP_SCHEDULE='[[1,32,6],[33,64,1],[65,256,0]]' bash recipes/qwen3_5-2b_verl_dynsd.sh
# This recipe runs the plan's best TailSieve configuration, tailsieve-spec: the tail pool at k = 6 on
# m = 4 replicas, the bulk pool on vLLM's documented schedule, q from 8; predicted 0.944x the pick
# (10-90 % band 0.911-0.989x), 2.70x stock verl: the A/B that checks the prediction on a real run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

model Qwen/Qwen3.5-2B
layout 1 0.6 table:h200-dense:qwen3-1.7b
tailsieve_mtp_tail 4 8 6 '[[1,64,3],[65,128,1],[129,256,0]]'
launch "$@"
