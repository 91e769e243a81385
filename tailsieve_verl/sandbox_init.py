"""First process (PID 1) of one code-reward candidate's namespaces: builds its file system, drops
privileges, runs it, and takes the whole namespace down with it.

Started by :mod:`tailsieve_verl.code_sandbox` as ``unshare --mount --net --pid --ipc --uts --fork
--kill-child <base python> -I -S sandbox_init.py <root> <limits>...`` (the integers of
:data:`LIMITS`, in that order) with the candidate program on stdin, so it uses the standard library
only, and few modules of it: its start-up is part of every candidate's time. It runs as root inside
fresh mount, network, PID, IPC and UTS namespaces and:

1. mounts a small tmpfs on ``<root>`` (an empty host folder) holding only read-only binds of
   ``/usr``, the interpreter's install and ``/dev/{null,zero,random,urandom}``, plus a private
   size-capped writable ``/tmp`` (the candidate's folder) owned by the candidate's user id;
2. moves that tmpfs over ``/`` and chroots into it, so no other host path has a name any more;
3. forks the candidate, which drops to a user id of its own (no capabilities, no new privileges)
   with CPU, address-space, process-count and core-size limits and execs the interpreter;
4. waits at most the wall-clock limit, then exits with the candidate's status (124 at the limit).
   When PID 1 exits the kernel kills every process left in the PID namespace, and the tmpfs
   mounts vanish with the mount namespace: the whole process tree and its files are gone.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 311}  # glibc has no keyctl() wrapper
DEVICES = ("null", "zero", "random", "urandom")
TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

_libc = ctypes.CDLL(None, use_errno=True)

# One candidate's bounds, given as command-line integers in this order: its own user and group id,
# wall clock (ms), CPU seconds, address space, processes and threads of its user id, size of /tmp.
LIMITS = ("uid", "timeout_ms", "cpu_s", "memory_bytes", "processes", "work_bytes")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = (lambda s: None if s is None else s.encode())
    if _libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _bind_read_only(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND)  # not recursive: mounts below ``source`` stay hidden
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def read_only_paths() -> list[str]:
    """What the candidate may read, bound in this order: the OS's /usr (the interpreter's shared
    libraries) and the interpreter's own install, wherever it lives (a pyenv or conda prefix, a
    separate mount under /usr, say)."""
    paths = ["/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))]
    return list(dict.fromkeys(paths))


def build_root(root: str, uid: int, work_bytes: int, program: bytes) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name in TOP_LEVEL_LINKS:  # merged-/usr systems: /lib -> usr/lib and so on
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind_read_only(host, os.path.join(root, name))
    for path in read_only_paths():
        _bind_read_only(path, root + path)
    for device in DEVICES:
        _bind_read_only("/dev/" + device, os.path.join(root, "dev", device))
    os.symlink("/tmp", os.path.join(root, "dev", "shm"))  # POSIX shared memory and semaphores
    work = os.path.join(root, "tmp")
    os.mkdir(work)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_bytes},mode=0700,uid={uid},gid={uid}")
    with open(os.path.join(work, "candidate.py"), "wb") as f:
        f.write(program)
    os.chown(os.path.join(work, "candidate.py"), uid, uid)
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def exec_candidate(limits: dict[str, int]) -> None:  # in the forked child; never returns
    uid = limits["uid"]
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # leaves root: every capability is gone
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # a new, empty session keyring: the inherited one is the trainer's, and possessing it is access
    if _libc.syscall(SYS_KEYCTL[os.uname().machine], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
    for kind, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_bytes"]),
                        (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))
    os.chdir("/tmp")
    os.execve(sys.executable, [sys.executable, "-I", "-S", "/tmp/candidate.py"],
              {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"})


def main(root: str, *limit_values: str) -> int:
    limits = dict(zip(LIMITS, map(int, limit_values), strict=True))
    program = sys.stdin.buffer.read()
    build_root(root, limits["uid"], limits["work_bytes"], program)
    child = os.fork()
    if child == 0:
        try:
            exec_candidate(limits)
        except BaseException as error:  # say why (the isolation check prints it), never run unbounded
            print(f"sandbox_init: cannot start the candidate: {error!r}", file=sys.stderr)
        os._exit(127)
    signal.signal(signal.SIGALRM, lambda *_: os._exit(124))
    signal.setitimer(signal.ITIMER_REAL, limits["timeout_ms"] / 1000)
    while True:  # as PID 1, also reap whatever the candidate orphans
        pid, status = os.wait()
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
