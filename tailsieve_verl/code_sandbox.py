"""Runs a code-reward candidate under its judge, isolated from the node where it can, and says
whether this node can.

Each candidate is judged by :mod:`tailsieve_verl.sandbox_init` (the judge: it forks the candidate,
runs the tests itself with the candidate answering only calls, and prints ``PASS <nonce>`` only if
every test ran and held; the nonce is a per-run secret of this process). Isolated, the judge runs
under util-linux ``unshare`` in new mount, network, PID, IPC and UTS namespaces, and the candidate
sees only a read-only ``/usr``, interpreter install and package folders and a private size-capped
``/tmp``. As root each candidate gets a fresh user id in both runners (no capabilities, no file
power of root's; its process count is its own); as an ordinary user, an unprivileged user namespace
(``--user --map-root-user``) gives the same namespaces, and the candidate keeps the namespace's root
id with every capability dropped. Where neither works, :func:`isolation_problem` says which in one
line, and the reward refuses to run candidates unless the user opts into the unisolated runner with
``TAILSIEVE_UNISOLATED_CODE_REWARD=1`` (the same judge and user id, no namespaces).

``python -m tailsieve_verl.code_sandbox --check-isolation`` runs that check (the recipes' launch
preflight for ``WORKLOAD=code``): exit 0 if candidates will run isolated, else 1 and the line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

UNISOLATED_ENV = "TAILSIEVE_UNISOLATED_CODE_REWARD"
# As root, each candidate runs as a fresh user id drawn from this range (no account needs to
# exist), so its process count (RLIMIT_NPROC counts per user id) is its own, not shared with the
# node's or other candidates' processes.
SANDBOX_UID_BASE = 0x70000000
SANDBOX_UID_SPAN = 1 << 24
SANDBOX_PROCESSES = 32  # processes and threads per candidate
SANDBOX_WORK_BYTES = 32 << 20  # the candidate's writable /tmp (memory-backed)
HOST_GRACE_S = 5.0  # the host's own backstop beyond the judge's wall-clock limit
INIT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_init.py")
NAMESPACES = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child")
USER_NAMESPACE = ("--user", "--map-root-user")
KEEP_UID = -1  # sandbox_init.KEEP_UID
# numpy's and its libraries' thread pools: one thread each, within the candidate's process bound
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# Run inside the sandbox by the isolation check: returns "ok" only if the sandbox is what we promise.
_PROBE = """\
def probe():
    import errno, os, socket
    try:
        os.chroot("/tmp")
    except PermissionError:
        pass
    else:
        raise AssertionError("the candidate has capabilities (it could chroot)")
    assert not os.path.exists({host_path!r}), "host files are visible"
    open("/tmp/probe", "w").write("ok")
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    except OSError as e:
        assert e.errno == errno.ENETUNREACH, f"the node's network is reachable ({{e}})"
    else:
        raise AssertionError("the node's network is reachable")
    return "ok"
"""


CGROUP_RETRY_S = 2.0  # a cgroup is removed once the kernel has let its last process go


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Controller ("memory", "pids"; "" for cgroup v2) -> (mount point, the mount's root path)."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, (fstype, _source, options) = line.split(" - ")[0].split(), line.split(" - ")[1].split()[:3]
            if fstype == "cgroup2":
                mounts.setdefault("", (fields[4], fields[3]))
            elif fstype == "cgroup":
                for controller in set(options.split(",")) & {"memory", "pids"}:
                    mounts[controller] = (fields[4], fields[3])
    return mounts


def _own_cgroup_folder(controller: str, mounts: dict[str, tuple[str, str]]) -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in (controllers.split(",") if controllers else [""]) and controller in mounts:
                mount, root = mounts[controller]
                relative = path[len(root):] if path.startswith(root) and root != "/" else path
                return mount + relative.rstrip("/")
    return None


@functools.cache
def cgroup_parents() -> tuple[str, tuple[str, ...]] | tuple[None, str]:
    """Where each candidate gets cgroups bounding its whole tree's memory and processes: ("v2", (the
    folder,)) for a cgroup v2 folder whose children get the memory and pids controllers (the parent of
    this process's cgroup: the one it is in holds processes, so its children cannot), ("v1", (memory
    folder, pids folder)) for writable v1 hierarchies (this process's own cgroups), else (None, why)."""
    try:
        mounts = _cgroup_mounts()
        own = _own_cgroup_folder("", mounts)
        if own is not None:
            parent = own if own == mounts[""][0] else os.path.dirname(own)
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if {"memory", "pids"} <= set(f.read().split()) and os.access(parent, os.W_OK):
                    return "v2", (parent,)
        folders = tuple(_own_cgroup_folder(c, mounts) for c in ("memory", "pids"))
        if all(folders) and all(os.access(folder, os.W_OK) for folder in folders):
            return "v1", folders
    except (OSError, ValueError, IndexError, KeyError) as error:
        return None, f"cannot read this process's cgroups ({error})"
    return None, "no writable cgroup with the memory and pids controllers"


def candidate_cgroups(memory_bytes: int, processes: int) -> list[str]:
    """New cgroups for one candidate, their limits set ([] where this node offers none)."""
    kind, parents = cgroup_parents()
    if kind is None:
        return []
    name = f"tailsieve-candidate-{os.getpid()}-{secrets.token_hex(4)}"
    limits = ({"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": processes} if kind == "v2" else
              {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes, "pids.max": processes})
    folders = [os.path.join(parent, name) for parent in parents]
    try:
        for folder in folders:
            os.mkdir(folder)
            for key, value in limits.items():
                if os.path.exists(os.path.join(folder, key)):  # memsw/swap files exist only with swap accounting
                    with open(os.path.join(folder, key), "w") as f:
                        f.write(str(value))
    except OSError:
        remove_cgroups(folders)
        raise
    return folders


def remove_cgroups(folders: list[str]) -> None:
    """Kill whatever is left in them, then remove them."""
    deadline = time.monotonic() + CGROUP_RETRY_S
    for folder in folders:
        while os.path.isdir(folder):
            try:
                if os.path.exists(os.path.join(folder, "cgroup.kill")):
                    with open(os.path.join(folder, "cgroup.kill"), "w") as f:
                        f.write("1")
                else:
                    with open(os.path.join(folder, "cgroup.procs")) as f:
                        for pid in f.read().split():
                            os.kill(int(pid), signal.SIGKILL)
                os.rmdir(folder)
            except FileNotFoundError:
                break
            except OSError:  # busy until the kernel has let its last process go
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)


def _interpreter() -> str:
    return os.path.realpath(sys.executable)


def sandbox_command(root: str) -> list[str]:
    """The argv that starts one candidate's judge isolated: ``unshare`` (with a user namespace
    unless root) starting the judge under the base interpreter (``-I -S``: no site-packages)."""
    user = () if os.geteuid() == 0 else USER_NAMESPACE
    return [shutil.which("unshare") or "unshare", *user, *NAMESPACES, _interpreter(), "-I", "-S", INIT_SCRIPT,
            "isolated", root]


def fresh_uid() -> int:
    return SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN)


def package_folders() -> list[str]:
    """The trainer's own package folders (numpy and the rest of its environment), which the
    candidate may import from, read-only."""
    return list(dict.fromkeys(os.path.realpath(p) for p in sys.path
                              if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)))


def _message(part: dict) -> bytes:
    body = json.dumps(part).encode()
    return len(body).to_bytes(8, "big") + body  # sandbox_init.read_message


def kill_every_process_of(uid: int) -> None:
    """The host's backstop where the judge itself was killed: every process of the candidate's fresh
    user id (kill(-1) as that user)."""
    subprocess.run([_interpreter(), "-I", "-S", "-c", "import os, signal; os.setgroups([]); "
                    f"os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid}); os.kill(-1, signal.SIGKILL)"],
                   capture_output=True, timeout=30)


def run_judged(job: dict, timeout_s: float, cpu_s: int, memory_bytes: int, isolated: bool) -> tuple[bool, str]:
    """Judge one candidate: (passed, the judge's line). ``job``: the candidate's ``code``; the
    ``tests``, the ``remote`` names they call in the candidate and the ``modules`` they use unimported,
    which only the judge sees (:func:`tailsieve_verl.rewards.judge_job`). Passed only if the judge
    printed this run's nonce."""
    nonce = secrets.token_hex(16)
    # As root the candidate runs as a fresh user id in both runners, so it has no file power of root's
    # and its process count (RLIMIT_NPROC counts per user id) is its own; in a user namespace the count
    # is the namespace's own. Unisolated as an ordinary user it keeps that user's id, whose count
    # covers every process of the trainer's user, so there is none.
    uid = fresh_uid() if os.geteuid() == 0 else KEEP_UID
    processes = SANDBOX_PROCESSES if isolated or uid != KEEP_UID else 0
    limits = [uid, round(1000 * timeout_s), cpu_s, memory_bytes, processes, SANDBOX_WORK_BYTES]  # sandbox_init.LIMITS
    cgroups = candidate_cgroups(memory_bytes, SANDBOX_PROCESSES)
    candidate_part = {"code": job["code"], "paths": package_folders(),
                      "cgroup_procs": [os.path.join(folder, "cgroup.procs") for folder in cgroups]}
    judge_part = {"tests": job["tests"], "remote": job["remote"], "modules": job["modules"], "nonce": nonce}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **dict.fromkeys(ONE_THREAD, "1")}
    done = None
    try:
        with tempfile.TemporaryDirectory(prefix="tailsieve_sandbox_") as root:
            argv = sandbox_command(root) if isolated else [_interpreter(), "-I", "-S", INIT_SCRIPT, "unisolated", root]
            try:
                done = subprocess.run([*argv, *map(str, limits)], input=_message(candidate_part) + _message(judge_part),
                                      capture_output=True, timeout=timeout_s + HOST_GRACE_S, env=env)
            except subprocess.TimeoutExpired:  # the judge was killed; --kill-child takes its namespace down
                pass
    finally:
        if not isolated and uid != KEEP_UID and (done is None or done.returncode != 0):
            kill_every_process_of(uid)
        remove_cgroups(cgroups)
    if done is None:
        return False, "the judge timed out"
    verdict = done.stdout.decode(errors="replace").strip()
    if verdict == f"PASS {nonce}":
        return True, "PASS"
    problem = done.stderr.decode(errors="replace").strip().splitlines()
    return False, verdict or (problem[-1] if problem else f"the judge exited {done.returncode} without a verdict")


def _remedy() -> str:
    return (f"run the trainer on Linux with util-linux `unshare`, as root or as a user allowed to create user "
            f"namespaces, in a container allowed to create namespaces and mount (e.g. docker run --privileged), "
            f"or set {UNISOLATED_ENV}=1 to run model-written code unisolated at your own risk "
            f"(docs/usage.md, 'Code reward isolation')")


def _user_namespace_refused() -> str | None:
    """None if this user may create a user namespace, else unshare's reason."""
    tried = subprocess.run([shutil.which("unshare") or "unshare", *USER_NAMESPACE, "true"], capture_output=True,
                           timeout=30)
    lines = tried.stderr.decode(errors="replace").strip().splitlines()
    return None if tried.returncode == 0 else (lines[-1] if lines else f"exit {tried.returncode}")


@functools.cache
def isolation_problem() -> str | None:
    """None if candidates run isolated on this node, else one line: why not and what to do."""
    if not sys.platform.startswith("linux"):
        why = f"needs Linux namespaces, this is {sys.platform}"
    elif shutil.which("unshare") is None:
        why = "util-linux `unshare` is not on PATH"
    elif os.geteuid() != 0 and (refused := _user_namespace_refused()) is not None:
        why = (f"needs root or unprivileged user namespaces: running as uid {os.geteuid()}, and this node "
               f"refuses a user namespace ({refused})")
    else:
        with tempfile.TemporaryDirectory(prefix="tailsieve_probe_") as host:  # a host file it must not see
            marker = os.path.join(host, "marker")
            open(marker, "w").close()
            probe = {"code": _PROBE.format(host_path=marker), "tests": ["assert probe() == 'ok'"],
                     "remote": ["probe"], "modules": []}
            passed, line = run_judged(probe, timeout_s=10.0, cpu_s=10, memory_bytes=1 << 30, isolated=True)
        if passed:
            return None
        how = "as root" if os.geteuid() == 0 else f"as uid {os.geteuid()} in a user namespace"
        why = f"the sandbox probe failed {how} ({line})"
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
