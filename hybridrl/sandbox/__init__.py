"""Run untrusted (model-written) Python in a local sandbox: `run(source, stdin, limits) -> Result`.

Each program runs in a fresh process tree in its own PID, network, mount, IPC and UTS namespaces,
under a user namespace of the jail's (`jail.py`, an interpreter started with an empty environment).

Isolated (each a program in tests/test_sandbox.py or tests/test_sandbox_hostile.py):
- the file system: read-only views of the system's /usr and /lib and the interpreter's prefix, with
  its site-packages (and a distribution's dist-packages) hidden: the standard library only, and the
  installed packages `Limits.packages` names, bound read-only under /packages; a private writable
  /tmp (a tmpfs of its own, 4x `file_mb`); nothing of the run directory, the checkpoints or the
  home directory. The trainer's environment variables are not passed.
- the network: a loopback interface, down; sockets of a family other than AF_UNIX, AF_INET, AF_INET6
  refused by the seccomp filter (no vsock, netlink, packet), raw sockets too.
- other processes: a PID namespace per program (it sees itself and its PID 1), no ptrace,
  process_vm_*, namespaces, mounts, BPF, keys, perf, io_uring, ...; when the program ends or hits the
  wall clock (enforced whatever it does with its pipes) every process it started goes.
- other programs: each is forked from a zygote that never held a request, so no program's memory
  holds another's source, stdin, output or tests.
- resources per program: CPU seconds, address space, file size, processes and threads (RLIMIT_NPROC,
  which counts in the jail's own user namespace: exactly `processes` a program), open files; SysV
  shared memory and message queues, POSIX message queues and memfds, which RLIMIT_AS does not count,
  are refused; with `Limits.fork` off, no new process (threads still), so one address space is all
  a program holds (`Limits.ceiling`). For all programs together: at most `slots()` run at once on
  this machine (an flock per slot across every process of this user), so what they hold is at most
  slots x ceiling: the memory plan counts it (`rewards.sandbox_bytes`, a row of `hybridrl plan`).
- what the caller sees: a jail's own failure comes on a pipe no program holds (status "jail"); output
  is kept up to `Limits.output_bytes` a stream, and more than the file-size limit kills the program.

Not isolated: the kernel itself (a kernel bug reachable through the allowed system calls), CPU time
and caches shared with the trainer (a program competes for the cores its rlimit allows), the clock,
/dev/urandom, what the read-only system files say about the machine (/usr, /proc's own view), and
resident memory across programs beyond the address-space bound (no cgroup: this machine's cgroups are
v1 and read-only).

Jails are kept warm, one per calling thread at a time: a program is forked from the jail's running
zygote, so it starts in milliseconds rather than an interpreter start's tens (`bench/sandbox.py`
measures both); programs listed in `PRELOAD` are compiled once per jail. Where the kernel refuses
what the jail needs (user namespaces off, seccomp missing), `available()` says so in one line naming
the fix, and callers refuse to start (no silent weakening).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

JAIL = Path(__file__).with_name("jail.py")
PROGRAM_UID = 1000  # the program's uid inside the namespace when the caller is root (mapped to nobody)
NOBODY = 65534
JAIL_FAILED = 125
JAIL_PROCESSES = 5  # ns, init, zygote, a program's fork and pid1: the jail's own, in its user namespace


# Programs the caller runs often, compiled (and their imports loaded) by each jail before its first
# request, so they start as fast as print(1): fixed text of the caller's own, never a request's.
PRELOAD: list[str] = []


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall clock of the whole tree
    cpu_s: int = 10  # CPU seconds of each process (RLIMIT_CPU)
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS)
    file_mb: int = 16  # the largest file a process may write; /tmp holds 4x this (64 MiB at least)
    processes: int = 32  # processes and threads (RLIMIT_NPROC)
    open_files: int = 64
    output_bytes: int = 64 << 10  # kept of stdout and of stderr; past file_mb in all, the program is killed
    fork: bool = True  # may start processes; False: threads only, so memory_mb bounds the whole program
    packages: tuple[str, ...] = ()  # installed packages the program may import (top-level names): none else

    @property
    def tmp_bytes(self) -> int:
        return max(4 * self.file_mb, 64) << 20

    @property
    def ceiling(self) -> int:
        """The most memory one program holds, whatever it does: each of its processes' address space
        (one process without `fork`) and its /tmp, a tmpfs in RAM."""
        return (self.processes if self.fork else 1) * (self.memory_mb << 20) + self.tmp_bytes


@dataclass
class Result:
    status: str  # ok | error (exit status != 0) | timeout (wall clock) | killed (a signal: CPU, memory, output) | jail
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False  # stdout or stderr was longer than Limits.output_bytes

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _python() -> tuple[str, str]:
    """The interpreter the program runs on (the real file, not a venv's link) and its prefix."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _binds(prefix: str) -> list[str]:
    return [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32") if os.path.lexists(p)] + (
        [prefix] if not prefix.startswith("/usr/") and prefix != "/usr" else []
    )


def _masks(prefix: str) -> list[str]:
    """The package directories the binds would show (the interpreter's site-packages, a distribution's
    dist-packages): each is hidden under an empty directory."""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    paths = {sysconfig.get_path(k, vars={"base": prefix, "platbase": prefix}) for k in ("purelib", "platlib")}
    paths |= {f"/usr/lib/{ver}/site-packages", f"/usr/local/lib/{ver}/dist-packages", "/usr/lib/python3/dist-packages"}
    return sorted(os.path.realpath(p) for p in paths if p and os.path.isdir(p))


def package_binds(names: tuple[str, ...]) -> list[list[str]]:
    """[path here, path in the jail] of each package the program may import, and of the libraries its
    wheel vendors beside it (numpy.libs), under /packages; ValueError naming one not installed."""
    import importlib.util

    out = []
    for name in names:
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
        where = (spec.submodule_search_locations or [spec.origin]) if spec else [None]
        if not where[0] or not os.path.exists(where[0]) or spec.origin in ("built-in", "frozen"):
            raise ValueError(f"the sandbox cannot offer package {name!r}: no such package is installed here")
        path = os.path.realpath(where[0])
        for p in (path, os.path.join(os.path.dirname(path), name + ".libs")):
            if os.path.exists(p):
                out.append([p, "/packages/" + os.path.basename(p)])
    return out


def _config(base: Path) -> dict:
    _, prefix = _python()
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:  # the namespace's root is root (it builds the jail); the program is nobody, whom NPROC binds
        maps = {"uid_map": f"0 0 1\n{PROGRAM_UID} {NOBODY} 1", "gid_map": f"0 0 1\n{PROGRAM_UID} {NOBODY} 1"}
    else:  # one id only: the program is this user, whose other processes count against NPROC too
        maps = {"uid_map": f"0 {uid} 1", "gid_map": f"0 {gid} 1"}
    return {
        "root": str(base / "root"),
        "binds": _binds(prefix),
        "masks": _masks(prefix),
        "preload": list(PRELOAD),
        "program_uid": PROGRAM_UID if uid == 0 else 0,
        **maps,
    }


def _remove(base: Path) -> None:
    def fix(func, path, _exc):  # a program may have left a directory without write permission
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass

    shutil.rmtree(base, onerror=fix)


class _Jail:
    """One jail kept warm (jail.py's serve mode): started once, then a program per request, each in
    namespaces and a /tmp of its own. Used by one thread at a time."""

    def __init__(self, packages: tuple[str, ...] = ()) -> None:
        binds = package_binds(packages)  # a package not installed fails here, before anything starts
        _sweep()
        self.base = Path(tempfile.mkdtemp(prefix=f"hybridrl-sandbox-{os.getpid()}-"))
        (self.base / "root").mkdir()
        jail = {**_config(self.base), "packages": binds}
        self.preloaded, self.packages = len(jail["preload"]), packages
        with open(self.base / "jail.err", "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(JAIL), json.dumps(jail)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env={},
                close_fds=True,
                start_new_session=True,
                cwd=str(self.base),
            )
        self.pending = b""

    def ask(self, req: dict, timeout: float) -> dict | None:
        """The jail's answer, or None if it died or did not answer in `timeout` seconds."""
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def why(self) -> str:
        """What the jail said on its way out (its own failures only)."""
        try:
            return (self.base / "jail.err").read_text(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the jail's PID 1 with it: its namespace empties
        except ProcessLookupError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        _remove(self.base)


def _sweep() -> None:
    """Remove the directories of jails whose starter is gone without closing them (killed: a reward
    worker past its timeout). Each holds an empty mount point and the jail's error log."""
    for d in Path(tempfile.gettempdir()).glob("hybridrl-sandbox-*-*"):
        pid = d.name.split("-")[2]
        try:
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}") and d.stat().st_uid == os.getuid():
                _remove(d)
        except OSError:  # another process swept it first
            pass


def slots() -> int:
    """How many sandboxed programs run at once on this machine, all callers together (reward workers,
    tool calls): `HYBRIDRL_SANDBOX_SLOTS`, else the CPUs (at least 2). What all of them may hold is
    this times `Limits.processes` processes of `Limits.memory_mb` each, plus a /tmp each."""
    try:
        return max(1, int(os.environ.get("HYBRIDRL_SANDBOX_SLOTS", "")))
    except ValueError:
        return max(2, os.cpu_count() or 1)


@contextlib.contextmanager
def _slot():
    """One of `slots()` machine-wide: an flock on a file of a directory per user, held while the
    program runs and dropped by the kernel if this process dies."""
    d = Path(tempfile.gettempdir()) / f"hybridrl-sandbox.slots-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    n, fd, wait = slots(), None, 0.001
    while fd is None:
        for i in range(n):
            f = os.open(d / str(i), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fd = f
                break
            except BlockingIOError:
                os.close(f)
        else:
            time.sleep(wait)
            wait = min(wait * 2, 0.05)
    try:
        yield
    finally:
        os.close(fd)


_IDLE: list[_Jail] = []
_LOCK = threading.Lock()
_OWNER = [os.getpid()]


def _take(packages: tuple[str, ...] = ()) -> _Jail:
    with _LOCK:
        if _OWNER[0] != os.getpid():  # a forked child: the parent's jails answer the parent only
            _IDLE.clear()
            _OWNER[0] = os.getpid()
        stale = [j for j in _IDLE if j.preloaded != len(PRELOAD)]  # started before a program was preloaded
        _IDLE[:] = [j for j in _IDLE if j.preloaded == len(PRELOAD)]
        jail = next((j for j in reversed(_IDLE) if j.packages == packages), None)  # its root shows those
        if jail is not None:
            _IDLE.remove(jail)
    for j in stale:
        j.close()
    return jail or _Jail(packages)


def _give(jail: _Jail) -> None:
    with _LOCK:
        if _OWNER[0] == os.getpid() and len(_IDLE) < max(4, os.cpu_count() or 1):
            _IDLE.append(jail)
            return
    jail.close()


@atexit.register
def shutdown() -> None:
    """Stop the jails kept warm (also at exit)."""
    with _LOCK:
        jails = list(_IDLE) if _OWNER[0] == os.getpid() else []
        _IDLE.clear()
    for jail in jails:
        jail.close()


def run(
    source: str,
    stdin: str = "",
    limits: Limits = Limits(),
    files: dict[str, str] | None = None,
    argv: list[str] | None = None,
) -> Result:
    """Run `source` as a Python program (as `python -I -S /tmp/prog.py`, beside `files` in its private
    /tmp) with `stdin` as its standard input; never raises for what the program does. `argv` runs
    that command instead ("{python}" names the interpreter), for a program that must be exec'd."""
    argv = [_python()[0] if a == "{python}" else a for a in argv] if argv else []
    req = {
        "source": source,
        "stdin": stdin,
        "files": files or {},
        "wall_s": limits.wall_s,
        "output_bytes": limits.output_bytes,
        "argv": argv,
        "limits": {
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_mb << 20,
            "file_bytes": limits.file_mb << 20,
            "tmp_bytes": limits.tmp_bytes,
            # counted per user namespace (each jail has its own) and uid: as root the program's uid
            # owns nothing else there; else the jail's own processes (ns, init, zygote, fork, pid1) too
            "processes": limits.processes + (0 if os.getuid() == 0 else JAIL_PROCESSES),
            "open_files": limits.open_files,
            "fork": limits.fork,
        },
    }
    with _slot():
        t0 = time.perf_counter()
        jail = _take(tuple(limits.packages))
        reply = jail.ask(req, limits.wall_s + 10)
        wall = time.perf_counter() - t0
    if reply is None:  # the jail died (it could not start here) or hung: a fresh one serves the next
        why = jail.why()
        jail.close()
        if "sandbox: " in why:
            return Result("jail", JAIL_FAILED, "", why, wall)
        return Result("timeout", -signal.SIGKILL, "", "", wall)
    _give(jail)
    code, err = reply["code"], reply["stderr"]
    if reply.get("jail"):  # reported on a pipe of the jail's own, never by what the program printed
        return Result("jail", JAIL_FAILED, reply["stdout"], reply["jail"], wall)
    if reply["timeout"]:
        status = "timeout"
    elif code == 0:
        status = "ok"
    elif code > 128:
        status = "killed"
    else:
        status = "error"
    return Result(status, code, reply["stdout"], err, wall, truncated=reply["truncated"])


_AVAILABLE: list = []


def available() -> str | None:
    """None where this machine can sandbox; else why not and what to do, in one line. Runs one
    program, once per process."""
    if not _AVAILABLE:
        _AVAILABLE.append(_probe())
    return _AVAILABLE[0]


def _probe() -> str | None:
    if sys.platform != "linux":
        return f"the code sandbox needs Linux namespaces and seccomp; this is {sys.platform}"
    if os.uname().machine != "x86_64":
        return f"the code sandbox's seccomp filter is written for x86_64; this is {os.uname().machine}"
    res = run("print(6 * 7)", limits=Limits(wall_s=30))
    if res.ok and res.stdout.strip() == "42":
        return None
    why = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
    fix = (
        (
            "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0)"
        )
        if "unshare" in why or "uid map" in why
        else "see `hybridrl doctor`"
    )
    return f"the code sandbox cannot start here ({why}): {fix}"


__all__ = ["Limits", "Result", "available", "run"]
