"""Runs a code-reward candidate isolated from the node, and says whether this node can.

Each candidate runs under util-linux ``unshare`` in new mount, network, PID, IPC and UTS
namespaces, as a user id of its own with no capabilities, seeing only a read-only ``/usr`` and
interpreter install and a private size-capped ``/tmp``; :mod:`tailsieve_verl.sandbox_init` (the
namespaces' PID 1) sets that up and enforces the limits. Needs Linux, root (to give each candidate
a fresh unprivileged user id, which bounds its processes) and ``unshare``; where any is missing,
:func:`isolation_problem` says so in one line, and the reward refuses to run candidates unless the
user opts into the unisolated runner with ``TAILSIEVE_UNISOLATED_CODE_REWARD=1``.

``python -m tailsieve_verl.code_sandbox --check-isolation`` runs that check (the recipes' launch
preflight for ``WORKLOAD=code``): exit 0 if candidates will run isolated, else 1 and the line.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

UNISOLATED_ENV = "TAILSIEVE_UNISOLATED_CODE_REWARD"
# Each candidate runs as a fresh user id drawn from this range (no account needs to exist), so its
# process count (RLIMIT_NPROC counts per user id) is its own, not shared with the node's or other
# candidates' processes.
SANDBOX_UID_BASE = 0x70000000
SANDBOX_UID_SPAN = 1 << 24
SANDBOX_PROCESSES = 32  # processes and threads per candidate
SANDBOX_WORK_BYTES = 32 << 20  # the candidate's writable /tmp (memory-backed)
HOST_GRACE_S = 5.0  # the host's own backstop beyond the init's wall-clock limit
INIT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py")
NAMESPACES = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child")

# Run inside the sandbox by the isolation check: exits 0 only if the sandbox is what we promise.
_PROBE = """\
import errno, os, socket
assert os.getuid() != 0 and os.geteuid() != 0, "candidate runs as root"
assert not os.path.exists({host_path!r}), "host files are visible"
open("/tmp/probe", "w").write("ok")
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
except OSError as e:
    assert e.errno == errno.ENETUNREACH, f"the node's network is reachable ({{e}})"
else:
    raise AssertionError("the node's network is reachable")
"""


def sandbox_command(root: str) -> list[str]:
    """The argv that runs one candidate: ``unshare`` starting the init under the base interpreter
    (``-I -S``: no site-packages, exactly as the unisolated runner)."""
    return [shutil.which("unshare") or "unshare", *NAMESPACES,
            os.path.realpath(sys.executable), "-I", "-S", INIT_SCRIPT, root]


def run_isolated(program: str, timeout_s: float, cpu_s: int, memory_bytes: int,
                 stderr: int = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """Run ``program`` in a fresh sandbox; returncode 0 iff it exited 0 within the limits."""
    limits = [SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN), round(1000 * timeout_s), cpu_s,
              memory_bytes, SANDBOX_PROCESSES, SANDBOX_WORK_BYTES]  # sandbox_init.LIMITS
    with tempfile.TemporaryDirectory(prefix="tailsieve_sandbox_") as root:
        try:
            return subprocess.run([*sandbox_command(root), *map(str, limits)], input=program.encode(),
                                  stdout=subprocess.DEVNULL, stderr=stderr, timeout=timeout_s + HOST_GRACE_S,
                                  env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        except subprocess.TimeoutExpired:  # unshare was killed; --kill-child takes its namespace down
            return subprocess.CompletedProcess([], 124)


def _remedy() -> str:
    return (f"run the trainer as root on Linux with util-linux `unshare`, in a container allowed to create "
            f"namespaces and mount (e.g. docker run --privileged), or set {UNISOLATED_ENV}=1 to run model-written "
            f"code unisolated at your own risk (docs/usage.md, 'Code reward isolation')")


@functools.cache
def isolation_problem() -> str | None:
    """None if candidates run isolated on this node, else one line: why not and what to do."""
    if not sys.platform.startswith("linux"):
        why = f"needs Linux namespaces, this is {sys.platform}"
    elif os.geteuid() != 0:
        why = f"needs root to give each candidate its own user id, running as uid {os.geteuid()}"
    elif shutil.which("unshare") is None:
        why = "util-linux `unshare` is not on PATH"
    else:
        probe = run_isolated(_PROBE.format(host_path=INIT_SCRIPT), timeout_s=10.0, cpu_s=10,
                             memory_bytes=1 << 30, stderr=subprocess.PIPE)
        if probe.returncode == 0:
            return None
        lines = (probe.stderr or b"").decode(errors="replace").strip().splitlines()
        why = f"the sandbox probe failed ({lines[-1] if lines else f'exit {probe.returncode}'})"
    return f"tailsieve code reward: isolation unavailable: {why}; {_remedy()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tailsieve_verl.code_sandbox", description=__doc__.split("\n")[0])
    parser.add_argument("--check-isolation", action="store_true", required=True,
                        help="exit 0 if code-reward candidates run isolated on this node, else print why and exit 1")
    parser.parse_args(argv)
    problem = isolation_problem()
    if problem is not None and os.environ.get(UNISOLATED_ENV) != "1":
        print(problem, file=sys.stderr)
        return 1
    if problem is not None:
        print(f"tailsieve code reward: running candidates UNISOLATED ({UNISOLATED_ENV}=1)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
