"""The trusted side of one code-reward candidate: the judge. It runs the tests itself and lets the
candidate's process only define the solution and answer calls; then it takes the candidate's whole
process tree down.

Started by :mod:`tailsieve_verl.code_sandbox` under the base interpreter (``-I -S``: the standard
library only, and few modules of it, as its start-up is part of every candidate's time) with two
length-prefixed JSON messages on stdin (the candidate's part: its code, cgroups and the read-only
package folders; then the judge's part: the tests, the names they call in the candidate and the
host's per-run nonce) and the integers of :data:`LIMITS` as arguments, in one of two ways:

* isolated: ``unshare [--user --map-root-user] --mount --net --pid --ipc --uts --fork --kill-child
  <python> -I -S sandbox_init.py isolated <root> <limits>...``. As the namespaces' PID 1 it mounts a small
  tmpfs on ``<root>`` (an empty host folder) holding only read-only binds of ``/usr``, the
  interpreter's install, the trainer's package folders and ``/dev/{null,zero,random,urandom}`` plus a
  private size-capped ``/tmp``, moves it over ``/`` and chroots into it. When PID 1 exits the kernel
  kills everything left in the PID namespace.
* unisolated: ``<python> -I -S sandbox_init.py unisolated <folder> <limits>...``, the folder (the
  host's, removed by the host) the candidate's working folder, the judge a child subreaper.

The judge forks the candidate after reading only the candidate's part, so the tests and the nonce
never exist in the candidate's memory. As root the candidate then becomes a fresh user id of its own
(no capability; the judge, the interpreter and the checkout are read-only to it; unisolated, it reads
the interpreter's install through folders the judge opened for it); in an unprivileged user
namespace it keeps the namespace's root id with every capability dropped. It defines its code and
answers calls: each call of a name the tests use but do not define (the entry point, say) is a
request from the judge's proxy, its arguments and result typed data (:func:`to_wire` /
:func:`from_wire`: plain values, big ints, the standard library's containers, dict views, Fraction,
Decimal, iterators read into lists, numpy values as lists, and callables as handles the judge calls
back), the arguments' mutations sent back. The judge decodes each reply strictly (bytes, items and
depth capped) under its own CPU and memory bounds, and prints ``PASS <nonce>`` only if every test ran
and held and the candidate answered every call; anything else (an exit, a signal, a timeout, an
unreadable reply) fails, whatever the candidate's exit status or output.
"""

from __future__ import annotations

import builtins
import ctypes
import json
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
REQUEST_FD, REPLY_FD = 3, 4  # the candidate reads calls from 3 and answers on 4; fds 0-2 are /dev/null
KEEP_UID = -1  # the ``uid`` limit meaning: run the candidate as the judge's own user
# What one reply may hold: its encoded bytes, its containers and scalars, its depth. The judge reads
# nothing bigger, so a hostile reply costs it at most this much.
MAX_REPLY_BYTES = 16 << 20
MAX_ITEMS = 1 << 20
MAX_DEPTH = 100
JUDGE_MEMORY_SLACK = 256 << 20  # the judge's own address space beyond the candidate's bound
HEADER_BYTES = 8
IMMUTABLE = (str, int, float, complex, tuple, bytes, frozenset, range, type(None))  # no mutation to send back

_libc = ctypes.CDLL(None, use_errno=True)

# One candidate's bounds, given as command-line integers in this order: its own user and group id
# (or KEEP_UID), wall clock (ms), CPU seconds, address space, processes and threads of its user id
# (0: unbounded), size of its /tmp (isolated).
LIMITS = ("uid", "timeout_ms", "cpu_s", "memory_bytes", "processes", "work_bytes")


# ---------------------------------------------------------------------------------------------
# typed data: what crosses between the judge and the candidate, both ways


class WireError(ValueError):
    """A value that cannot cross: unsupported, too big, too deep, or malformed."""


def _hashed(kind: type, items) -> object:
    """A set or dict built one item at a time: the judge's CPU bound (SIGXCPU) can stop colliding
    hashes between two items, where one C call would hold it until the hard bound kills it."""
    built: dict | set = set() if kind in (set, frozenset) else {}
    add = built.add if isinstance(built, set) else (lambda kv: built.__setitem__(*kv))
    for item in items:
        add(item)
    return frozenset(built) if kind is frozenset else built


# container tags whose body is a list of encoded items / of [key, value] pairs
_SEQUENCES = {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}
_PAIRS = ("dict", "counter", "ordereddict", "defaultdict", "items")


def _tagged_collection(v: object) -> str | None:
    kind = type(v)
    if kind.__module__ == "collections" and kind.__name__ in ("deque", "Counter", "OrderedDict", "defaultdict"):
        return kind.__name__.lower()
    if kind.__name__ in ("dict_keys", "dict_values", "dict_items") and kind.__module__ == "builtins":
        return kind.__name__[5:]
    return None


def to_wire(v: object, handles: list, depth: int = 0, budget: list | None = None) -> object:
    """``v`` as JSON-able typed data. Callables become handles (indices into ``handles``) that the
    other side calls back; iterators are read into a list. WireError past the caps."""
    budget = [0] if budget is None else budget
    budget[0] += 1
    if depth > MAX_DEPTH or budget[0] > MAX_ITEMS:
        raise WireError(f"more than {MAX_ITEMS} items or {MAX_DEPTH} levels")
    d = depth + 1
    if v is None or v is True or v is False:
        return v
    if isinstance(v, int):
        n = int(v)
        return {"int": format(n, "x")} if n.bit_length() > 13000 else n  # JSON's ints stop at 4,300 digits
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, list):
        return [to_wire(x, handles, d, budget) for x in list.__iter__(v)]
    if isinstance(v, complex):
        return {"complex": [v.real, v.imag]}
    if isinstance(v, (bytes, bytearray)):
        return {type(v).__name__ if type(v) is bytearray else "bytes": bytes(v).hex()}
    tag = _tagged_collection(v)
    if tag in ("counter", "ordereddict", "defaultdict", "items") or isinstance(v, dict):
        pairs = dict.items(v) if isinstance(v, dict) else v
        return {tag if tag else "dict": [[to_wire(k, handles, d, budget), to_wire(x, handles, d, budget)]
                                          for k, x in pairs]}
    if tag is not None:
        return {tag: [to_wire(x, handles, d, budget) for x in v]}
    for kind, name in ((tuple, "tuple"), (frozenset, "frozenset"), (set, "set")):
        if isinstance(v, kind):
            return {name: [to_wire(x, handles, d, budget) for x in kind.__iter__(v)]}
    if isinstance(v, range):
        return {"range": [v.start, v.stop, v.step]}
    module, name = type(v).__module__, type(v).__name__
    if name == "Fraction" and module == "fractions":
        return {"fraction": [to_wire(v.numerator, handles, d, budget), to_wire(v.denominator, handles, d, budget)]}
    if name == "Decimal" and module in ("decimal", "_decimal"):
        return {"decimal": str(v)}
    if module.split(".")[0] == "numpy" and hasattr(v, "tolist"):  # arrays as lists, scalars as Python's
        return to_wire(v.tolist(), handles, d, budget)
    if hasattr(type(v), "__next__"):  # a generator or other iterator, read here
        items = []
        for x in v:
            items.append(to_wire(x, handles, d, budget))
        return {"iter": items}
    if callable(v):
        handles.append(v)
        return {"callable": len(handles) - 1}
    raise WireError(f"a {name} is not data the judge reads")


def from_wire(t: object, callable_for, depth: int = 0, budget: list | None = None) -> object:
    """Fresh objects from :func:`to_wire`'s data, strictly: exact types, caps on items and depth;
    ``callable_for(handle)`` makes a handle callable. WireError for anything else. (The modules of
    the rarer types are imported when one comes: imports are part of every candidate's time.)"""
    budget = [0] if budget is None else budget
    budget[0] += 1
    if depth > MAX_DEPTH or budget[0] > MAX_ITEMS:
        raise WireError(f"more than {MAX_ITEMS} items or {MAX_DEPTH} levels")
    d = depth + 1
    kind = type(t)
    if t is None or kind in (bool, int, float, str):
        return t
    if kind is list:
        return [from_wire(x, callable_for, d, budget) for x in t]
    if kind is not dict or len(t) != 1:
        raise WireError("malformed data")
    (tag, body), = t.items()
    body_kind = type(body)
    items = (lambda: [from_wire(x, callable_for, d, budget) for x in body])
    pairs = (lambda: [(from_wire(p[0], callable_for, d, budget), from_wire(p[1], callable_for, d, budget))
                      for p in body])
    if body_kind is list and tag in ("set", "frozenset"):
        return _hashed(_SEQUENCES[tag], items())
    if body_kind is list and tag in _SEQUENCES:
        return _SEQUENCES[tag](items())
    if body_kind is list and tag == "deque":
        from collections import deque

        return deque(items())
    if body_kind is list and tag in ("keys", "values"):
        values = items()
        return dict.fromkeys(values).keys() if tag == "keys" else dict(enumerate(values)).values()
    if body_kind is list and tag in _PAIRS and all(type(p) is list and len(p) == 2 for p in body):
        built = _hashed(dict, pairs())
        if tag in ("dict", "items"):
            return built.items() if tag == "items" else built
        from collections import Counter, OrderedDict, defaultdict

        return {"counter": Counter, "ordereddict": OrderedDict, "defaultdict": lambda kv: defaultdict(None, kv)}[tag](built)
    if body_kind is str and tag in ("bytes", "bytearray", "int", "decimal"):
        try:
            if tag == "decimal":
                from decimal import Decimal

                return Decimal(body)
            return {"bytes": bytes.fromhex, "bytearray": bytearray.fromhex, "int": lambda s: int(s, 16)}[tag](body)
        except (ValueError, ArithmeticError):
            raise WireError(f"malformed {tag}") from None
    numbers = body_kind is list and all(type(x) in (int, float) for x in body)
    if tag == "complex" and numbers and len(body) == 2:
        return complex(*body)
    if tag == "range" and numbers and len(body) == 3 and all(type(x) is int for x in body) and body[2] != 0:
        return range(*body)
    if tag == "fraction" and body_kind is list and len(body) == 2:
        numerator, denominator = items()
        if type(numerator) is int and type(denominator) is int and denominator != 0:
            from fractions import Fraction

            return Fraction(numerator, denominator)
    if tag == "callable" and body_kind is int:
        return callable_for(body)
    raise WireError(f"malformed data (tag {str(tag)[:20]!r})")


def encode(message: object) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode("utf-8", "surrogatepass")


def decode(body: bytes) -> object:
    """The JSON of a message, refused before parsing when it holds more containers than the caps."""
    if body.count(b"[") + body.count(b"{") > MAX_ITEMS:
        raise WireError(f"more than {MAX_ITEMS} items")
    try:
        return json.loads(body.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        raise WireError("not JSON") from None


def write_message(fd: int, body: bytes, deadline: float | None = None) -> None:
    data = memoryview(len(body).to_bytes(HEADER_BYTES, "big") + body)
    while data:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError("the candidate did not take its call in time")
        data = data[os.write(fd, data[:1 << 16]):]


def read_message(fd: int, deadline: float | None = None, max_bytes: int | None = None) -> bytes | None:
    """One message, or None at EOF; TimeoutError past the deadline, WireError over ``max_bytes``."""
    def read_exact(n: int) -> bytes | None:
        got = bytearray()
        while len(got) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError("no answer in time")
            chunk = os.read(fd, min(n - len(got), 1 << 20))
            if not chunk:
                return None
            got += chunk
        return bytes(got)

    header = read_exact(HEADER_BYTES)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if max_bytes is not None and size > max_bytes:
        raise WireError(f"a reply of {size} bytes, over {max_bytes}")
    return read_exact(size)


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
    separate mount under /usr, say); the trainer's package folders follow (``build_root``)."""
    paths = ["/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))]
    return list(dict.fromkeys(paths))


def build_root(root: str, owner: int, work_bytes: int, packages: list[str]) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name in TOP_LEVEL_LINKS:  # merged-/usr systems: /lib -> usr/lib and so on
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind_read_only(host, os.path.join(root, name))
    for path in [*read_only_paths(), *map(os.path.realpath, packages)]:
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


def _opened_roots(paths: list[str]) -> dict[str, str]:
    """Unisolated, a fresh user id may not pass the folders above the interpreter's install (a
    pyenv under /root, say): each import root, opened here as root, is read through
    ``/proc/self/fd/<n>`` instead, which reaches that folder and nothing above it."""
    roots = {}
    for root in dict.fromkeys(os.path.realpath(p) for p in [sys.base_prefix, *paths]):
        fd, kept = os.open(root, os.O_PATH | os.O_DIRECTORY), REPLY_FD + 1 + len(roots)
        if fd != kept:
            os.dup2(fd, kept, inheritable=False)
            os.close(fd)
        roots[root] = f"/proc/self/fd/{kept}"
    return roots


def _import_from(roots: dict[str, str], paths: list[str]) -> None:
    """Point every import path (sys.path and the packages already imported) through ``roots``."""
    def moved(path: str) -> str:
        real = os.path.realpath(path)
        for root, opened in roots.items():
            if real == root or real.startswith(root + "/"):
                return opened + real[len(root):]
        return path

    sys.path[:] = [moved(p) for p in [*sys.path, *paths]]
    for module in list(sys.modules.values()):
        if type(getattr(module, "__path__", None)) is list:
            module.__path__[:] = [moved(p) for p in module.__path__]
    sys.path_importer_cache.clear()


def start_candidate(limits: dict[str, int], part: dict, workdir: str, isolated: bool, cgroups: list[int],
                    request_fd: int, reply_fd: int) -> None:
    for procs in cgroups:  # its cgroups (opened before the chroot): the bounds over its whole tree
        os.write(procs, str(os.getpid()).encode())
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(request_fd, REQUEST_FD)
    os.dup2(reply_fd, REPLY_FD)
    uid = limits["uid"]
    roots = _opened_roots(part["paths"]) if uid != KEEP_UID and not isolated else {}
    os.closerange(REPLY_FD + 1 + len(roots), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.setsid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if uid != KEEP_UID:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaves root: every capability is gone
    elif os.geteuid() == 0:  # root of a user namespace: the id, not the powers
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
    _import_from(roots, part["paths"])
    serve(part["code"])


def _raised(error: BaseException) -> dict:
    try:
        text = str(error)[:500]
    except Exception:
        text = ""
    kind = "raise" if isinstance(error, Exception) else "exit"  # SystemExit and the like end the candidate
    return {kind: [type(error).__name__, text]}


def serve(code: str) -> None:
    """Define the candidate's code, then answer the judge's calls until it closes the channel."""
    namespace: dict = {"__name__": "candidate", "__builtins__": builtins}
    handles: list = []
    try:
        exec(compile(code, "candidate.py", "exec"), namespace)
        reply: dict = {"ready": True}
    except BaseException as error:
        reply = _raised(error)
    write_message(REPLY_FD, encode(reply))
    while (body := read_message(REQUEST_FD)) is not None:
        try:
            request = json.loads(body)
            call = request["call"]
            if type(call) is str and call not in namespace:
                raise NameError(f"name {call!r} is not defined")
            target = namespace[call] if type(call) is str else handles[call]
            take = (lambda h: handles[h])
            args = [from_wire(a, take) for a in request["args"]]
            kwargs = {k: from_wire(v, take) for k, v in request["kwargs"]}
        except BaseException as error:
            reply = _raised(error)
        else:
            try:
                value = target(*args, **kwargs)
            except BaseException as error:
                reply = _raised(error)
            else:
                try:
                    reply = {"value": to_wire(value, handles)}
                    sent = [*enumerate(zip(args, request["args"])), *zip(kwargs, zip(kwargs.values(), request["kwargs"]))]
                    changed = [[k, now] for k, (a, before) in sent if not isinstance(a, IMMUTABLE)
                               and (now := to_wire(a, handles)) != (before if type(k) is int else before[1])]
                    if changed:
                        reply["mutated"] = changed
                except BaseException as error:
                    reply = {"unreadable": f"{type(error).__name__}: {str(error)[:200]}"}
        try:
            message = encode(reply)
        except BaseException as error:
            message = encode({"unreadable": f"{type(error).__name__}"})
        write_message(REPLY_FD, message)
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# the judge


class CandidateGone(BaseException):
    """The candidate broke off (exited, timed out, sent what the judge cannot read): the verdict is
    a failure whatever the tests do with it (a BaseException, so ``except Exception`` in a test
    cannot swallow it; the channel remembers it besides)."""


class CandidateError(Exception):
    """The candidate raised an exception that is not one of the builtins."""


class JudgeOutOfTime(BaseException):
    """The judge's own CPU bound (SIGXCPU): a reply too costly to judge."""


def _raise_remote(kind: str, text: str) -> None:
    error = getattr(builtins, kind, None)
    if isinstance(error, type) and issubclass(error, Exception):
        try:
            raised = error(text)
        except Exception:
            raised = CandidateError(f"{kind}: {text}")
        raise raised
    raise CandidateError(f"{kind}: {text}")


class Channel:
    """The judge's end of the candidate's calls; ``broken`` says why the candidate can no longer pass."""

    def __init__(self, request_fd: int, reply_fd: int, deadline: float):
        self.request_fd, self.reply_fd, self.deadline = request_fd, reply_fd, deadline
        self.broken: str | None = None

    def _fail(self, why: str):
        self.broken = self.broken or why
        raise CandidateGone(self.broken)

    def receive(self) -> dict:
        try:
            body = read_message(self.reply_fd, self.deadline, MAX_REPLY_BYTES)
            reply = None if body is None else decode(body)
        except TimeoutError:
            self._fail("the candidate timed out")
        except WireError as error:
            self._fail(f"an unreadable reply: {error}")
        if reply is None:
            self._fail("the candidate exited or was killed before answering")
        if type(reply) is not dict or len(reply) not in (1, 2):
            self._fail("a malformed reply")
        return reply

    def ready(self) -> None:
        """The candidate's code defined without raising, else CandidateGone saying what it raised."""
        reply = self.receive()
        if reply != {"ready": True}:
            raised = next(iter(reply.values()))
            what = f"{str(raised[0])[:40]}: {str(raised[1])[:200]}" if type(raised) is list and len(raised) == 2 else "?"
            self._fail(f"the code raised {what} when defined")

    def call(self, target: str | int, args: tuple, kwargs: dict) -> object:
        """One call into the candidate: its result, or the builtin exception it raised. Anything the
        judge cannot send or read breaks the channel (CandidateGone), so no test's ``except`` turns
        it into a pass."""
        if self.broken:
            raise CandidateGone(self.broken)
        try:
            handles: list = []
            request = encode({"call": target, "args": [to_wire(a, handles) for a in args],
                              "kwargs": [[k, to_wire(v, handles)] for k, v in kwargs.items()]})
            if handles:
                raise WireError("the judge sends the candidate data, not functions")
        except BaseException as error:
            self._fail(f"the test's arguments cannot be sent ({type(error).__name__}: {str(error)[:100]})")
        try:
            write_message(self.request_fd, request, self.deadline)
        except (TimeoutError, OSError):
            self._fail("the candidate stopped taking calls")
        reply = self.receive()
        if set(reply) == {"raise"} and type(reply["raise"]) is list and len(reply["raise"]) == 2:
            _raise_remote(str(reply["raise"][0])[:40], str(reply["raise"][1])[:500])
        if "exit" in reply:
            self._fail(f"the candidate ended itself ({str(reply['exit'])[:80]})")
        if "unreadable" in reply:
            self._fail(f"a result the judge cannot read ({str(reply['unreadable'])[:200]})")
        if "value" not in reply or not set(reply) <= {"value", "mutated"} or type(reply.get("mutated", [])) is not list:
            self._fail("a malformed reply")
        remote = (lambda handle: Remote(self, handle, f"{target}'s result"))
        try:
            value = from_wire(reply["value"], remote)
            for entry in reply.get("mutated", []):
                key, data = entry if type(entry) is list and len(entry) == 2 else (None, None)
                original = (args[key] if type(key) is int and 0 <= key < len(args)
                            else kwargs.get(key) if type(key) is str else None)
                if original is None or not _update_in_place(original, from_wire(data, remote)):
                    raise WireError("a malformed mutation")
        except CandidateGone:
            raise
        except BaseException as error:  # WireError, or the judge's own bounds (memory, CPU)
            self._fail(f"an unreadable reply ({type(error).__name__}: {str(error)[:100]})")
        return value


def _update_in_place(original: object, new: object) -> bool:
    """The candidate's mutation of an argument, applied to the judge's own object."""
    if type(original) is not type(new):
        return False
    if isinstance(original, (list, bytearray)):
        original[:] = new
    elif isinstance(original, (dict, set)):
        original.clear()
        original.update(new)
    elif hasattr(original, "extend") and hasattr(original, "clear"):  # deque
        original.clear()
        original.extend(new)
    else:
        return False
    return True


class Remote:
    """The judge's stand-in for a callable of the candidate's: each call is a request into the sandbox."""

    def __init__(self, channel: Channel, target: str | int, name: str):
        self._channel, self._target, self.__name__ = channel, target, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self._target, args, kwargs)

    def __repr__(self) -> str:
        return f"<the candidate's {self.__name__}>"


def _describe(error: BaseException, tests: list[str]) -> str:
    """What failed, with the innermost test line it failed on."""
    line = ""
    tb = error.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith("<test ") and name[6:-1].isdigit():
            lines = tests[int(name[6:-1])].splitlines()
            line = lines[tb.tb_lineno - 1].strip() if 0 < tb.tb_lineno <= len(lines) else line
        tb = tb.tb_next
    what = "a test failed" if isinstance(error, AssertionError) else f"a test raised {type(error).__name__}"
    return f"{what}: {line[:200]}" if line else f"{what}: {str(error)[:200]}"


def run_tests(part: dict, channel: Channel, paths: list[str]) -> str | None:
    """None if the candidate answered every call and every test ran and held, else why not."""
    try:
        channel.ready()
        namespace: dict = {"__builtins__": builtins, "__name__": "__main__"}
        sys.path += paths  # the tests may import the trainer's packages too
        for name in part["modules"]:  # standard modules the tests name without importing them
            namespace[name] = __import__(name)
        for name in part["remote"]:
            namespace[name] = Remote(channel, name, name)
        for k, test in enumerate(part["tests"]):
            try:
                exec(compile(test, f"<test {k}>", "exec"), namespace)
            except CandidateGone:
                raise
            except BaseException as error:
                return channel.broken or _describe(error, part["tests"])
    except CandidateGone:
        return channel.broken
    except BaseException as error:  # the judge's own bounds, or anything the setup did
        return channel.broken or f"the judge stopped: {type(error).__name__}"
    return channel.broken


def _on_sigxcpu(*_):
    raise JudgeOutOfTime("the judge ran out of CPU time")


def bound_the_judge(limits: dict[str, int]) -> None:
    """The judge's own CPU and memory bounds, once the candidate is started: a reply that is costly
    to decode or compare (colliding hashes, say) stops the judge, not the trainer."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + limits["cpu_s"] + 1
    signal.signal(signal.SIGXCPU, _on_sigxcpu)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    memory = limits["memory_bytes"] + JUDGE_MEMORY_SLACK
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def _kill_every_process_of(uid: int) -> None:
    """A fresh user id's processes are all the candidate's: kill(-1) as that user reaches them all."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


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


def kill_tree(isolated: bool, uid: int) -> None:
    """Kill every process the candidate started and reap them. Isolated, the judge is the PID
    namespace's init (kill(-1) reaches all of it and nothing else); unisolated, it is their
    subreaper, and each round kills every process of the candidate's fresh user id (or, where the
    candidate kept the judge's id, every descendant) until none is left."""
    while True:
        if not isolated and uid != KEEP_UID:
            _kill_every_process_of(uid)
        for pid in ([-1] if isolated else [] if uid != KEEP_UID else _descendants()):
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
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/<pid>/mem or fd for its own user
    os.umask(0o022)
    part = json.loads(read_message(0))  # the candidate's part only: the tests are read after the fork
    isolated = mode == "isolated"
    uid = limits["uid"]
    owner = os.geteuid() if uid == KEEP_UID else uid
    cgroups = [os.open(path, os.O_WRONLY) for path in part["cgroup_procs"]]
    if isolated:
        build_root(folder, owner, limits["work_bytes"], part["paths"])
        folder = "/tmp"
    else:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        os.chown(folder, owner, owner)
    request_read, request_write = os.pipe()
    reply_read, reply_write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            start_candidate(limits, part, folder, isolated, cgroups, request_read, reply_write)
        except BaseException as error:  # say why (the isolation check prints it), never run unbounded
            print(f"sandbox_init: cannot start the candidate: {error!r}", file=sys.stderr)
        os._exit(127)
    for fd in (request_read, reply_write, *cgroups):
        os.close(fd)
    tests = json.loads(read_message(0))
    bound_the_judge(limits)
    why_not = run_tests(tests, Channel(request_write, reply_read, deadline), part["paths"])
    kill_tree(isolated, uid)
    print(f"PASS {tests['nonce']}" if why_not is None else f"FAIL {why_not}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
