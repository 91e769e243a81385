"""The trusted side of one code-reward candidate: the judge. It runs the candidate in a child process,
judges the child's answers itself, and takes the child's whole process tree down.

Started by :mod:`tailsieve_verl.code_sandbox` under the base interpreter (``-I -S``, so it uses the
standard library only, and few modules of it: its start-up is part of every candidate's time) with
the job (JSON) on stdin and the integers of :data:`LIMITS` as arguments, in one of two ways:

* isolated: ``unshare [--user --map-root-user] --mount --net --pid --ipc --uts --fork --kill-child
  <python> -I -S sandbox_init.py isolated <root> <limits>...``. As the namespaces' PID 1 it mounts a small
  tmpfs on ``<root>`` (an empty host folder) holding only read-only binds of ``/usr``, the
  interpreter's install and ``/dev/{null,zero,random,urandom}`` plus a private size-capped ``/tmp``,
  moves it over ``/`` and chroots into it; the candidate then drops to a user id of its own (as
  root) or, in a user namespace, keeps the namespace's root user with every capability dropped.
  When PID 1 exits the kernel kills everything left in the PID namespace.
* unisolated: ``<python> -I -S sandbox_init.py unisolated <folder> <limits>...``, the folder (the
  host's, removed by the host) the candidate's working folder, the judge a child subreaper so that
  whatever the candidate starts, even in a session of its own, stays its descendant and is killed;
  as root the candidate keeps uid 0 without any capability.

The verdict cannot be forged by the candidate: the job's expected sides never reach the child; the
child only evaluates each call of the entry point (``calls``) and writes the values, encoded as
plain data (int, float, complex, str, bytes, bool, None, list, tuple, dict, set, frozenset), on a pipe; the
judge decodes them into fresh objects of those types (no candidate-defined ``__eq__`` survives) and
evaluates every test itself (``checks``, with the calls' values bound to ``_tailsieve_call_<k>``).
It prints ``PASS <nonce>`` (the host's per-run secret) only when every value came back and every
check held; anything else (an exit of any kind, a signal, a timeout, a bad reply) is a failure,
whatever the candidate's exit status or output.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import marshal
import os
import resource
import select
import signal
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flag -> mount flag: a bind of a mount that has these set must keep them in a user namespace
LOCKED_MOUNT_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
                      os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 24, 28
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 36, 38, 47, 4
# noroot, no-setuid-fixup, no-ambient-raise and keep-caps (off), each locked: uid 0 gains nothing by exec
SECUREBITS_NO_ROOT_POWERS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
KEYCTL_JOIN_SESSION_KEYRING = 1
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 311}  # glibc has no keyctl() wrapper
DEVICES = ("null", "zero", "random", "urandom")
TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
REPLY_FD = 3  # the candidate writes its values here; fds 0-2 are /dev/null
MAX_REPLY_BYTES = 16 << 20
KEEP_UID = -1  # the ``uid`` limit meaning: run the candidate as the judge's own user

_libc = ctypes.CDLL(None, use_errno=True)

# One candidate's bounds, given as command-line integers in this order: its own user and group id
# (or KEEP_UID), wall clock (ms), CPU seconds, address space, processes and threads of its user id
# (0: unbounded), size of its /tmp (isolated).
LIMITS = ("uid", "timeout_ms", "cpu_s", "memory_bytes", "processes", "work_bytes")

# What the candidate's process runs (``python -I -S -c``): the candidate's code, then each call, and
# one line of JSON (the values, encoded as plain data) on REPLY_FD. It reads its job with marshal and
# writes JSON by hand: both need no import, and imports are part of every candidate's time. It is
# untrusted once the candidate's code runs; the judge trusts nothing it writes but plain data.
RUNNER = r"""
import marshal, os
with open("job.marshal", "rb") as f:
    job = marshal.load(f)
ESCAPES = {c: "\\u%04x" % c for c in range(32)}
ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\"})
SPECIAL_FLOATS = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}

def js(v, depth=0):
    if depth > 100:
        raise ValueError("nested too deeply")
    d = depth + 1
    if v is None or v is True or v is False:
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, int):
        return int.__repr__(v)
    if isinstance(v, float):
        text = float.__repr__(v)
        return SPECIAL_FLOATS.get(text, text)
    if isinstance(v, str):
        return '"' + str.__str__(v).translate(ESCAPES) + '"'
    if isinstance(v, list):
        return "[" + ",".join(js(x, d) for x in list.__iter__(v)) + "]"
    tagged = {tuple: ("tuple", lambda: tuple.__iter__(v)), set: ("set", lambda: iter(set(v))),
              frozenset: ("frozenset", lambda: iter(set(v))), dict: ("dict", lambda: ([k, x] for k, x in dict.items(v))),
              complex: ("complex", lambda: iter([v.real, v.imag]))}
    for kind, (tag, items) in tagged.items():
        if isinstance(v, kind):
            return '{"%s":[%s]}' % (tag, ",".join(js(x, d) for x in items()))
    if isinstance(v, (bytes, bytearray)):
        return '{"bytes":"%s"}' % bytes(v).hex()
    raise TypeError("returns a %s, not plain data" % type(v).__name__)

namespace = {"__name__": "candidate"}
exec(compile(job["code"], "candidate.py", "exec"), namespace)
for line in job["setup"]:
    exec(compile(line, "setup", "exec"), namespace)
replies = []
for call in job["calls"]:
    try:
        replies.append('{"value":%s}' % js(eval(call, namespace)))
    except Exception as error:
        replies.append('{"error":%s}' % js("%s: %s" % (type(error).__name__, error)))
os.write(3, ("[" + ",".join(replies) + "]\n").encode("utf-8", "surrogatepass"))
"""


# ---------------------------------------------------------------------------------------------
# the isolated file system (as the namespaces' root)


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
    kept = os.statvfs(source).f_flag
    flags = sum(mount for stat, mount in LOCKED_MOUNT_FLAGS.items() if kept & stat)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags)


def read_only_paths() -> list[str]:
    """What the candidate may read, bound in this order: the OS's /usr (the interpreter's shared
    libraries) and the interpreter's own install, wherever it lives (a pyenv or conda prefix, a
    separate mount under /usr, say)."""
    paths = ["/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))]
    return list(dict.fromkeys(paths))


def build_root(root: str, owner: int, work_bytes: int) -> None:
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
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_bytes},mode=0700,uid={owner},gid={owner}")
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ---------------------------------------------------------------------------------------------
# the candidate's process (forked by the judge; never returns)


def _drop_every_capability() -> None:
    """For a candidate that stays uid 0 of a user namespace: no capability now or after exec."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if cap == 0 or _libc.prctl(PR_SET_SECUREBITS, SECUREBITS_NO_ROOT_POWERS, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP / PR_SET_SECUREBITS)")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def exec_candidate(limits: dict[str, int], reply_fd: int, workdir: str, isolated: bool, cgroups: list[int]) -> None:
    for procs in cgroups:  # its cgroups (opened before the chroot): the bounds over its whole tree
        os.write(procs, str(os.getpid()).encode())
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(reply_fd, REPLY_FD)
    os.closerange(REPLY_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.setsid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    uid = limits["uid"]
    if uid != KEEP_UID:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaves root: every capability is gone
    elif os.geteuid() == 0:  # root of a user namespace, or unisolated root: the id, not the powers
        _drop_every_capability()
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if isolated:  # a new, empty session keyring: the inherited one is the trainer's, and possessing it is access
        if _libc.syscall(SYS_KEYCTL[os.uname().machine], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
            raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
    bounds = [(resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_bytes"]),
              (resource.RLIMIT_CORE, 0)]
    if limits["processes"] > 0:
        bounds.append((resource.RLIMIT_NPROC, limits["processes"]))
    for kind, value in bounds:
        resource.setrlimit(kind, (value, value))
    os.chdir(workdir)
    os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", RUNNER],
              {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"})


# ---------------------------------------------------------------------------------------------
# the judge


def from_plain(data: object) -> object:
    """Fresh objects of the plain types from the candidate's JSON; ValueError for anything else."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [from_plain(x) for x in data]
    if type(data) is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag == "tuple" and type(body) is list:
            return tuple(from_plain(x) for x in body)
        if tag == "set" and type(body) is list:
            return {from_plain(x) for x in body}
        if tag == "frozenset" and type(body) is list:
            return frozenset(from_plain(x) for x in body)
        if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {from_plain(k): from_plain(v) for k, v in body}
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
            return complex(*body)
    raise ValueError(f"not plain data: {str(data)[:80]}")


def read_reply(fd: int, deadline: float) -> bytes:
    """The candidate's first line, or what came before EOF, the deadline or the size bound."""
    reply = b""
    while b"\n" not in reply and len(reply) < MAX_REPLY_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        reply += chunk
    return reply.split(b"\n", 1)[0] if b"\n" in reply else b""


def judge(job: dict, reply: bytes) -> str | None:
    """None if every call returned plain data and every check holds, else why not."""
    if not reply:
        return "no reply (the candidate exited, was killed or timed out before answering every call)"
    try:
        answers = json.loads(reply.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        return "the reply is not JSON"
    if type(answers) is not list or len(answers) != len(job["calls"]):
        return "the reply does not answer every call"
    namespace: dict = {"__builtins__": builtins}
    for k, answer in enumerate(answers):
        if type(answer) is not dict or "value" not in answer:
            error = answer.get("error") if type(answer) is dict else None
            return f"call {job['calls'][k]} failed: {str(error)[:200]}"
        try:
            namespace[f"_tailsieve_call_{k}"] = from_plain(answer["value"])
        except (ValueError, TypeError, RecursionError) as error:
            return f"call {job['calls'][k]}: {error}"
    try:
        for line in job["setup"]:
            exec(line, namespace)
        for name in job["modules"]:  # modules the checks name but the setup does not import
            namespace.setdefault(name, __import__(name))
        for check in job["checks"]:
            if not eval(check, namespace):
                return f"check failed: {check[:200]}"
    except Exception as error:
        return f"a check raised {type(error).__name__}: {str(error)[:200]}"
    return None


def _children_by_parent(frontier: list[int]) -> list[int]:
    """The children of the processes in ``frontier``: from /proc/<pid>/task/<tid>/children where the
    kernel has them (CONFIG_PROC_CHILDREN), else from every process's parent in /proc/<pid>/stat."""
    children: list[int] = []
    if os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        for pid in frontier:
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        children += map(int, f.read().split())
            except OSError:  # gone meanwhile
                continue
        return children
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) in frontier:
                    children.append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return children


def _descendants() -> list[int]:
    found, frontier = [], [os.getpid()]
    while frontier:
        frontier = _children_by_parent(frontier)
        found += frontier
    return found


def kill_tree(isolated: bool) -> None:
    """Kill every process the candidate started and reap them. Isolated, the judge is the PID
    namespace's init (kill(-1) reaches all of it and nothing else); unisolated, it is their
    subreaper, so each round kills every descendant until none is left."""
    while True:
        for pid in ([-1] if isolated else _descendants()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)


def main(mode: str, folder: str, *limit_values: str) -> int:
    limits = dict(zip(LIMITS, map(int, limit_values), strict=True))
    deadline = time.monotonic() + limits["timeout_ms"] / 1000
    job = json.loads(sys.stdin.buffer.read())
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/<pid>/mem or fd for its own user
    isolated = mode == "isolated"
    owner = os.geteuid() if limits["uid"] == KEEP_UID else limits["uid"]
    cgroups = [os.open(path, os.O_WRONLY) for path in job["cgroup_procs"]]
    if isolated:
        build_root(folder, owner, limits["work_bytes"])
        folder = "/tmp"
    else:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    with open(os.path.join(folder, "job.marshal"), "wb") as f:  # what the candidate may know
        marshal.dump({"code": job["code"], "setup": job["setup"], "calls": job["calls"]}, f)
    if owner != os.geteuid():
        os.chown(os.path.join(folder, "job.marshal"), owner, owner)
    reply_read, reply_write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            exec_candidate(limits, reply_write, folder, isolated, cgroups)
        except BaseException as error:  # say why (the isolation check prints it), never run unbounded
            print(f"sandbox_init: cannot start the candidate: {error!r}", file=sys.stderr)
        os._exit(127)
    os.close(reply_write)
    reply = read_reply(reply_read, deadline)
    kill_tree(isolated)
    why_not = judge(job, reply)
    print(f"PASS {job['nonce']}" if why_not is None else f"FAIL {why_not}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
