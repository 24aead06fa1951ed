"""The sandbox's jail: programs run in fresh Linux namespaces, under limits and a seccomp filter.

Started by `hybridrl.sandbox` as `python -I -S jail.py CONFIG` with an empty environment, never
imported by the trainer: it uses the standard library only, so the trainer's packages need not be
visible to it. A jail is kept warm: it reads one request a line on its stdin (a program, its stdin,
files and limits) and answers a line on its stdout (exit status, output). Its processes:

  outer  - stays in the caller's namespaces; forks `ns`, writes its uid/gid maps, waits, exits with its
           status. As root it maps the namespace's root to root (to build the jail) and `program_uid`
           to nobody, whom programs run as: root is exempt from RLIMIT_NPROC, nobody is not.
  ns     - unshares user, mount, PID, network, IPC and UTS namespaces, then forks `init`.
  init   - PID 1 of the jail: builds a root of read-only binds (the system's /usr, /lib, the
           interpreter's prefix), a fresh /proc and four devices, chroots there, and serves requests.

Each program then gets a process tree of its own, forked from this already-started interpreter (a
fork costs a few milliseconds where an interpreter start costs tens):

  fork   - unshares mount, PID, network, IPC and UTS namespaces again (new ones under the jail's user
           namespace), mounts a new tmpfs on /tmp holding the program and its files, forks `pid1`,
           reports its pid, exits.
  pid1   - PID 1 of the program's own PID namespace: mounts its /proc, forks the program, waits for
           it. When pid1 exits, the kernel kills every process left in the namespace: children that
           called setsid or double-forked die with it.
  program- rlimits (CPU seconds, address space, file size, processes, open files), no new privileges,
           no capabilities, the seccomp filter; then the source runs in this interpreter as
           `__main__` (run_source: what `python -I -S /tmp/prog.py` does), or an argv is exec'd.

`init` writes the program's stdin, keeps its stdout and stderr (capped), and kills `pid1`, so the
whole namespace, at the wall-clock limit or when output passes the file-size limit. Programs see
nothing of each other: every namespace but the user one, and /tmp, are new per program. The network
namespace has only a loopback interface, down: nothing on this machine or beyond is reachable, not
even a loopback service. Exit status: the program's, or 128 + signal; 125 when the jail failed (its
reason on stderr, prefixed "sandbox:").
"""

import ctypes
import functools
import json
import os
import resource
import select
import signal
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    16384,
    1 << 18,
)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 38, 22, 24, 28
SECCOMP_MODE_FILTER = 2
LOCKED = ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))
JAIL_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, dst, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")


# --- seccomp ------------------------------------------------------------------------------------------
AUDIT_ARCH_X86_64 = 0xC000003E
# x86_64 system call numbers a program that computes has no use for: other processes' memory, the
# kernel's state, namespaces, mounts, keys, BPF, modules, the clock, raw I/O ports
DENIED = {
    101: "ptrace",
    165: "mount",
    166: "umount2",
    155: "pivot_root",
    161: "chroot",
    246: "kexec_load",
    320: "kexec_file_load",
    321: "bpf",
    250: "keyctl",
    248: "add_key",
    249: "request_key",
    272: "unshare",
    308: "setns",
    175: "init_module",
    313: "finit_module",
    176: "delete_module",
    169: "reboot",
    167: "swapon",
    168: "swapoff",
    298: "perf_event_open",
    323: "userfaultfd",
    310: "process_vm_readv",
    311: "process_vm_writev",
    303: "name_to_handle_at",
    304: "open_by_handle_at",
    163: "acct",
    164: "settimeofday",
    227: "clock_settime",
    159: "adjtimex",
    172: "iopl",
    173: "ioperm",
    179: "quotactl",
    428: "open_tree",
    429: "move_mount",
    430: "fsopen",
    431: "fsconfig",
    432: "fsmount",
    433: "fspick",
    442: "mount_setattr",
    139: "sysfs",
    134: "uselib",
    154: "modify_ldt",
    212: "lookup_dcookie",
    425: "io_uring_setup",
    426: "io_uring_enter",
    427: "io_uring_register",
}
NR_CLONE, NR_CLONE3, NR_SOCKET = 56, 435, 41
AF_PACKET, SOCK_RAW = 17, 3
EPERM, ENOSYS = 1, 38


@functools.lru_cache(maxsize=None)  # built once in the jail, installed by every program
def seccomp_filter() -> bytes:
    """A classic-BPF program: other architectures killed; the DENIED calls, clone with a namespace flag
    and packet or raw sockets fail with EPERM; clone3 with ENOSYS (its flags are behind a pointer, so
    libc falls back to clone, whose flags the filter reads); the rest allowed."""
    LD_W_ABS, JEQ, JSET, JGE, RET, AND = 0x20, 0x15, 0x45, 0x35, 0x06, 0x54
    ALLOW, KILL = 0x7FFF0000, 0x80000000

    def errno(e):
        return 0x00050000 | e

    prog = []

    def op(code, k, jt=0, jf=0):
        prog.append((code, jt, jf, k))

    op(LD_W_ABS, 4)  # seccomp_data.arch
    op(JEQ, AUDIT_ARCH_X86_64, 1, 0)
    op(RET, KILL)
    op(LD_W_ABS, 0)  # seccomp_data.nr
    op(JGE, 0x40000000, 0, 1)  # the x32 ABI
    op(RET, errno(EPERM))
    for nr in sorted(DENIED):
        op(JEQ, nr, 0, 1)
        op(RET, errno(EPERM))
    op(JEQ, NR_CLONE3, 0, 1)
    op(RET, errno(ENOSYS))
    op(JEQ, NR_CLONE, 0, 4)
    op(LD_W_ABS, 16)  # args[0], low word: clone's flags
    op(JSET, NAMESPACES | CLONE_NEWCGROUP, 0, 1)
    op(RET, errno(EPERM))
    op(RET, ALLOW)
    op(JEQ, NR_SOCKET, 0, 6)
    op(LD_W_ABS, 16)  # socket's domain
    op(JEQ, AF_PACKET, 3, 0)
    op(LD_W_ABS, 24)  # its type, less SOCK_NONBLOCK / SOCK_CLOEXEC
    op(AND, 0xF)
    op(JEQ, SOCK_RAW, 0, 1)
    op(RET, errno(EPERM))
    op(RET, ALLOW)
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def install_seccomp() -> None:
    code = seccomp_filter()
    buf = ctypes.create_string_buffer(code)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(code) // 8, ctypes.addressof(buf))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def drop_privileges(uid: int) -> None:
    """Become `uid` (0: stay the namespace's root) with no capability left and none regained by an
    exec as uid 0 (securebits NOROOT, locked), the bounding set emptied."""
    NOROOT, NOROOT_LOCKED, KEEP_CAPS_LOCKED, NO_AMBIENT_RAISE, NO_AMBIENT_RAISE_LOCKED = 1, 2, 32, 64, 128
    bits = NOROOT | NOROOT_LOCKED | KEEP_CAPS_LOCKED | NO_AMBIENT_RAISE | NO_AMBIENT_RAISE_LOCKED
    _check(libc.prctl(PR_SET_SECUREBITS, bits, 0, 0, 0), "securebits")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    if uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # clears the capabilities: SECBIT_NO_SETUID_FIXUP is not set
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    _check(libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(bytes(24))), "capset")


# --- the file system -----------------------------------------------------------------------------------
def build_root(root: str, binds: list[str]) -> None:
    """`root`: a tmpfs holding read-only binds of `binds` at their own paths (symlinks such as a
    merged /bin copied as links), an empty /tmp, a fresh /proc and four device nodes."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in binds:
        dst = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.lexists(dst):
                os.symlink(os.readlink(path), dst)
            continue
        if not os.path.exists(path) or os.path.lexists(dst) and not os.path.isdir(dst):
            continue
        os.makedirs(dst, exist_ok=True)
        _mount(path, dst, None, MS_BIND | MS_REC)
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        st = os.statvfs(dst)  # a remount must keep the flags the outer mount locked (noexec, atime, ...)
        for st_flag, ms_flag in LOCKED:
            flags |= ms_flag if st.f_flag & st_flag else 0
        _mount(None, dst, None, flags)
    os.makedirs(root + "/tmp")  # where each program's own tmpfs goes
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "urandom", "random"):
        open(f"{root}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # only /tmp is writable
    os.chroot(root)
    os.chdir("/tmp")


def set_limits(cfg: dict) -> None:
    for name, value in (
        ("RLIMIT_CPU", cfg["cpu_s"]),
        ("RLIMIT_AS", cfg["memory_bytes"]),
        ("RLIMIT_FSIZE", cfg["file_bytes"]),
        ("RLIMIT_NPROC", cfg["processes"]),
        ("RLIMIT_NOFILE", cfg["open_files"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def _status(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "TMPDIR": "/tmp",
}


def init(cfg: dict) -> int:
    """PID 1 of the jail: the root, then requests served until the caller closes their pipe."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    build_root(cfg["root"], cfg["binds"])
    return serve(cfg)


# --- kept warm: a program per request, each in namespaces of its own --------------------------------
PROGRAM_NS = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS


def serve(cfg: dict) -> int:
    """Answer requests (a JSON line each on fd 0) until end of input; the control pipes move above
    the program's fds, so no program inherits them."""
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0), os.dup2(null, 1), os.close(null)
    seccomp_filter()  # built before any program: each fork finds it cached
    import atexit  # noqa: F401  what run_source needs, imported once: each program is spared it
    import io  # noqa: F401
    import traceback  # noqa: F401
    import types  # noqa: F401

    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(ctl_in, 1 << 16)
            if not chunk:
                return 0
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        reply = run_one(cfg, json.loads(line), ctl=(ctl_in, ctl_out))
        os.write(ctl_out, json.dumps(reply).encode() + b"\n")


def run_one(cfg: dict, req: dict, ctl: tuple) -> dict:
    lim = req["limits"]
    r0, w0 = os.pipe()
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    rp, wp = os.pipe()
    a = os.fork()
    if a == 0:  # fork: fresh namespaces and /tmp, then pid1
        code = JAIL_FAILED
        try:
            for fd in (w0, r1, r2, rp, *ctl):
                os.close(fd)
            _check(libc.unshare(PROGRAM_NS), "unshare")
            uid = cfg["program_uid"]
            _mount(
                "tmpfs",
                "/tmp",
                "tmpfs",
                MS_NOSUID | MS_NODEV,
                f"size={lim['tmp_bytes']},nr_inodes=4096,mode=700,uid={uid},gid={uid}",
            )
            for name, text in {"prog.py": req["source"], **req["files"]}.items():
                with open(f"/tmp/{name}", "w", encoding="utf-8") as f:
                    f.write(text)
                os.chown(f"/tmp/{name}", uid, uid)
            b = os.fork()
            if b == 0:
                os.close(wp)
                os._exit(pid1(cfg, req, (r0, w1, w2)))
            os.write(wp, str(b).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(w2, f"sandbox: {e}\n".encode())
        os._exit(code)
    for fd in (r0, w1, w2, wp):
        os.close(fd)
    got = b""
    while chunk := os.read(rp, 32):
        got += chunk
    os.close(rp)
    os.waitpid(a, 0)
    b = int(got) if got else None
    out, err, timed_out, cut = _talk(b, w0, r1, r2, req["stdin"].encode(), lim, req["wall_s"], req["output_bytes"])
    if b is None:
        return {"code": JAIL_FAILED, "stdout": out, "stderr": err, "timeout": False, "truncated": cut}
    _, status = os.waitpid(b, 0)  # pid1 is this process's child once `fork` has exited
    return {"code": _status(status), "stdout": out, "stderr": err, "timeout": timed_out, "truncated": cut}


def _talk(b, w0, r1, r2, data: bytes, lim: dict, wall_s: float, cap: int) -> tuple:
    """Feed stdin, keep up to `cap` bytes of stdout and of stderr, until both close; kill pid1 (and
    so the namespace) at the deadline or past the file-size limit. Returns (out, err, timed_out, cut)."""
    deadline = time.monotonic() + wall_s
    bufs, total, timed_out, killed = {r1: bytearray(), r2: bytearray()}, 0, False, b is None
    open_r = [r1, r2]
    if not data or b is None:
        os.close(w0)
        w0 = None
    else:
        os.set_blocking(w0, False)
    while open_r:
        left = deadline - time.monotonic()
        if left <= 0 and not killed:
            timed_out = killed = _kill(b)
        if killed:  # the namespace is going: its pipes close in a moment
            left = 1.0
        ready_r, ready_w, _ = select.select(open_r, [w0] if w0 is not None else [], [], max(left, 0.0))
        if w0 is not None and ready_w:
            try:
                data = data[os.write(w0, data[: 1 << 16]) :]
            except OSError:  # the program closed its stdin
                data = b""
            if not data:
                os.close(w0)
                w0 = None
        for fd in ready_r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_r.remove(fd)
                os.close(fd)
                continue
            total += len(chunk)
            if len(bufs[fd]) <= cap:
                bufs[fd] += chunk[: cap + 1 - len(bufs[fd])]
            if total > lim["file_bytes"] and not killed:  # what RLIMIT_FSIZE does to a file
                killed = _kill(b)
    if w0 is not None:
        os.close(w0)
    cut = any(len(v) > cap for v in bufs.values())

    def text(v):
        return bytes(v[:cap]).decode("utf-8", "replace")

    return text(bufs[r1]), text(bufs[r2]), timed_out, cut


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)  # PID 1 of the program's namespace: the kernel kills the rest
    except ProcessLookupError:
        pass
    return True


def pid1(cfg: dict, req: dict, fds: tuple) -> int:
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this namespace's processes only
        c = os.fork()
        if c == 0:
            try:
                serve_program(cfg, req, fds)
            except BaseException as e:  # noqa: BLE001
                os.write(fds[2], f"sandbox: {e}\n".encode())
            os._exit(JAIL_FAILED)
    except BaseException as e:  # noqa: BLE001
        os.write(fds[2], f"sandbox: {e}\n".encode())
        return JAIL_FAILED
    for fd in fds:
        os.close(fd)
    while True:
        done, status = os.wait()
        if done == c:
            return _status(status)


def serve_program(cfg: dict, req: dict, fds: tuple) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 1 << 20)
    os.chdir("/tmp")
    set_limits(req["limits"])
    drop_privileges(cfg["program_uid"])
    install_seccomp()
    if req.get("argv"):
        os.execve(req["argv"][0], req["argv"], ENV)
    os._exit(run_source(req["source"]))


def run_source(source: str) -> int:
    """What `python -I -S /tmp/prog.py` does, in this interpreter: a fresh __main__, sys.argv and
    sys.path[0] for /tmp, new standard streams, the traceback without this frame, atexit handlers
    and non-daemon threads awaited. Returns the exit status."""
    import atexit
    import builtins
    import io
    import traceback
    import types  # all imported already by serve()

    os.environ.clear()
    os.environ.update(ENV)
    sys.argv, sys.path[0] = ["/tmp/prog.py"], "/tmp"
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = "/tmp/prog.py", builtins
    sys.modules["__main__"] = main
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    code = 0
    try:
        exec(compile(source, "/tmp/prog.py", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001  a closed or full pipe
            code = code or 120
    return code


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def main() -> int:
    cfg = json.loads(sys.argv[1])
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # ns
        os.close(ready_r), os.close(go_w)
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _check(libc.unshare(NAMESPACES), "unshare (user namespaces off? see `hybridrl doctor`)")
            os.write(ready_w, b"1")
            if os.read(go_r, 1) != b"1":
                raise OSError("the outer process could not map this namespace's user")
            os.setgid(0), os.setuid(0)
            child = os.fork()
            if child == 0:
                try:
                    code = init(cfg)
                except BaseException as e:  # noqa: BLE001
                    os.write(2, f"sandbox: {e}\n".encode())
                    code = JAIL_FAILED
                os._exit(code)
            _, status = os.waitpid(child, 0)
            os._exit(_status(status))
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"sandbox: {e}\n".encode())
            os._exit(JAIL_FAILED)
    os.close(ready_w), os.close(go_r)
    ok = b"0"
    if os.read(ready_r, 1) == b"1":
        try:
            if os.getuid() != 0:  # an unprivileged user may map its own ids only, and deny setgroups first
                with open(f"/proc/{pid}/setgroups", "w") as f:
                    f.write("deny")
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(cfg[name])
            ok = b"1"
        except OSError as e:
            os.write(2, f"sandbox: uid map: {e}\n".encode())
    os.write(go_w, ok)
    _, status = os.waitpid(pid, 0)
    return _status(status)


if __name__ == "__main__":
    sys.exit(main())
