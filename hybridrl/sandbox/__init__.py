"""Run untrusted (model-written) Python in a local sandbox: `run(source, stdin, limits) -> Result`.

Each program runs in a fresh process tree (`jail.py`, started as its own interpreter with an empty
environment) in its own user, PID, network, mount, IPC and UTS namespaces: no network at all (a
loopback interface, down), a private writable /tmp and read-only views of the system's /usr and
/lib and the interpreter's prefix (nothing of the run directory, the checkpoints, the home directory,
the site-packages or the trainer's environment variables); rlimits on CPU seconds, address space, file
size, processes and open files; no capabilities and a seccomp filter (no ptrace, mount, kexec, bpf,
keyctl, namespaces, packet or raw sockets, ...). A wall-clock limit kills the whole tree: the jail's
PID 1 waits for the program, and when it goes every process left in the namespace goes too, also
children that called setsid or double-forked. Output is kept up to `Limits.output_bytes` a stream
(its files are bounded by the file-size limit).

The cost is two interpreter starts per program (the jail's and the program's); `bench/sandbox.py`
measures it. Where the kernel refuses what the jail needs (user namespaces off, seccomp missing),
`available()` says so in one line naming the fix, and callers refuse to start (no silent weakening).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

JAIL = Path(__file__).with_name("jail.py")
PROGRAM_UID = 1000  # the program's uid inside the namespace when the caller is root (mapped to nobody)
NOBODY = 65534
JAIL_FAILED = 125


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall clock of the whole tree
    cpu_s: int = 10  # CPU seconds of each process (RLIMIT_CPU)
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS)
    file_mb: int = 16  # the largest file a process may write, its stdout and stderr included
    processes: int = 32  # processes and threads (RLIMIT_NPROC)
    open_files: int = 64
    output_bytes: int = 64 << 10  # kept of stdout and of stderr


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
    return [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32") if os.path.lexists(p)] \
        + ([prefix] if not prefix.startswith("/usr/") and prefix != "/usr" else [])


def _processes_of(uid: int) -> int:
    """Processes (threads count against RLIMIT_NPROC too) this uid runs now."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = os.stat(f"/proc/{d}")
                if st.st_uid == uid:
                    n += len(os.listdir(f"/proc/{d}/task"))
            except OSError:
                pass
    return n


def _config(base: Path, argv: list[str], limits: Limits) -> dict:
    exe, prefix = _python()
    root = os.getuid() == 0
    uid, gid = os.getuid(), os.getgid()
    if root:  # the namespace's root is root (it builds the jail); the program is nobody, whom NPROC binds
        maps = {"uid_map": f"0 0 1\n{PROGRAM_UID} {NOBODY} 1", "gid_map": f"0 0 1\n{PROGRAM_UID} {NOBODY} 1"}
        processes = limits.processes + _processes_of(NOBODY)
    else:  # one id only: the program is this user, whose other processes count against NPROC too
        maps = {"uid_map": f"0 {uid} 1", "gid_map": f"0 {gid} 1"}
        processes = limits.processes + _processes_of(uid)
    return {"root": str(base / "root"), "work": str(base / "work"), "binds": _binds(prefix),
            "argv": [exe if a == "{python}" else a for a in argv], "program_uid": PROGRAM_UID if root else 0,
            "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20, "file_bytes": limits.file_mb << 20,
            "processes": processes, "open_files": limits.open_files, **maps}


def _read(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", "replace"), len(data) > cap


def _remove(base: Path) -> None:
    def fix(func, path, _exc):  # a program may have left a directory without write permission
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass
    shutil.rmtree(base, onerror=fix)


def run(source: str, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None,
        argv: list[str] | None = None) -> Result:
    """Run `source` as a Python program (`python -I -S prog.py` in /tmp, the work dir, beside `files`)
    with `stdin` as its standard input; never raises for what the program does."""
    base = Path(tempfile.mkdtemp(prefix="hybridrl-sandbox-"))
    try:
        work = base / "work"
        work.mkdir()
        (base / "root").mkdir()
        (work / "prog.py").write_text(source, encoding="utf-8")
        for name, text in (files or {}).items():
            (work / name).write_text(text, encoding="utf-8")
        if os.getuid() == 0:  # the program is nobody: its /tmp must be its own
            for p in [work, *work.iterdir()]:
                os.chown(p, NOBODY, NOBODY)
        os.chmod(base, 0o755)  # nobody walks through to /tmp's mount source; nothing else is in base
        (base / "stdin").write_text(stdin, encoding="utf-8")
        cfg = _config(base, argv or ["{python}", "-I", "-S", "/tmp/prog.py"], limits)
        t0 = time.perf_counter()
        with open(base / "stdin", "rb") as fin, open(base / "stdout", "wb") as fout, \
                open(base / "stderr", "wb") as ferr:
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL), json.dumps(cfg)], stdin=fin, stdout=fout,
                                    stderr=ferr, env={}, close_fds=True, start_new_session=True, cwd=str(base))
            try:
                code = proc.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the jail's PID 1 with it: the namespace empties
                except ProcessLookupError:
                    pass
                code = proc.wait()
        wall = time.perf_counter() - t0
        out, cut_out = _read(base / "stdout", limits.output_bytes)
        err, cut_err = _read(base / "stderr", limits.output_bytes)
    finally:
        _remove(base)
    if timed_out:
        status = "timeout"
    elif code == JAIL_FAILED and "sandbox: " in err:
        status = "jail"
    elif code == 0:
        status = "ok"
    elif code > 128:
        status = "killed"
    else:
        status = "error"
    return Result(status, code, out, err, wall, truncated=cut_out or cut_err)


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
    fix = ("enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu "
           "kernel.apparmor_restrict_unprivileged_userns=0)") if "unshare" in why or "uid map" in why else \
        "see `hybridrl doctor`"
    return f"the code sandbox cannot start here ({why}): {fix}"


__all__ = ["Limits", "Result", "available", "run"]
