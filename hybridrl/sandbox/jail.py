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
           interpreter's prefix, its site-packages hidden under empty directories), a fresh /proc and
           four devices, chroots there, forks `zygote`, then serves requests.
  zygote - forked before the first request, so its memory never holds one: it compiles the caller's
           preloaded programs (cfg "preload", fixed text such as the code_tests harness), then forks
           a `fork` process per request. init hands it that request's pipes (SCM_RIGHTS); the
           request itself (source, files, limits) goes from init to `fork` on a pipe of its own, and
           the program's stdin on another: no program's memory holds what an earlier one read,
           wrote or was given, and none holds its own stdin but by reading it.

Each program then gets a process tree of its own, forked from the zygote's already-started
interpreter (a fork costs a few milliseconds where an interpreter start costs tens):

  fork   - reads its request, unshares mount, PID, network, IPC and UTS namespaces again (new ones
           under the jail's user namespace), mounts a new tmpfs on /tmp holding the program and its
           files, forks `pid1`, reports its pid, exits.
  pid1   - PID 1 of the program's own PID namespace: mounts its /proc, forks the program, waits for
           it. When pid1 exits, the kernel kills every process left in the namespace: children that
           called setsid or double-forked die with it.
  program- rlimits (CPU seconds, address space, file size, processes, open files), no new privileges,
           no capabilities, the seccomp filter; then the source runs in this interpreter as
           `__main__` (run_source: what `python -I -S /tmp/prog.py` does), or an argv is exec'd.

`init` writes the program's stdin, keeps its stdout and stderr (capped), and kills `pid1`, so the
whole namespace, at the wall-clock limit (watched on a pidfd: closing its pipes changes nothing) or
when output passes the file-size limit. Programs see nothing of each other: every namespace but the
user one, and /tmp, are new per program. The network namespace has only a loopback interface, down:
nothing on this machine or beyond is reachable, not even a loopback service; sockets of any family
but AF_UNIX, AF_INET and AF_INET6 are refused (AF_VSOCK is not network-namespaced). Exit status: the
program's, or 128 + signal. A failure of the jail's own (a mount, an unshare, the filter) is written
to a pipe no program holds, and answered as "jail"; a program that exits 125 and prints "sandbox:"
is a program that failed.
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
    # memory the rlimits do not count (RLIMIT_AS), which outlives or escapes the program's processes
    29: "shmget",
    68: "msgget",
    240: "mq_open",
    319: "memfd_create",
    447: "memfd_secret",
}
NR_CLONE, NR_CLONE3, NR_SOCKET, NR_SOCKETPAIR, NR_FORK, NR_VFORK = 56, 435, 41, 53, 57, 58
CLONE_THREAD = 0x00010000
AF_UNIX, AF_INET, AF_INET6, SOCK_RAW = 1, 2, 10, 3
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)  # an allow-list: no vsock, netlink, packet, bluetooth, ...
EPERM, EAGAIN, ENOSYS = 1, 11, 38


@functools.lru_cache(maxsize=None)  # built once in the jail, installed by every program
def seccomp_filter(fork: bool = True) -> bytes:
    """A classic-BPF program: other architectures killed; the DENIED calls, clone with a namespace flag,
    sockets of a family outside SOCKET_FAMILIES (AF_VSOCK reaches the host: it is not network-namespaced)
    and raw sockets fail with EPERM; clone3 with ENOSYS (its flags are behind a pointer, so libc falls
    back to clone, whose flags the filter reads); without `fork`, a new process (fork, vfork, clone
    without CLONE_THREAD) fails with EAGAIN, as at RLIMIT_NPROC, and threads are still made; the rest
    allowed."""
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
    if not fork:  # one process: its address space (RLIMIT_AS) is all the memory the program holds
        op(JEQ, NR_FORK, 1, 0)
        op(JEQ, NR_VFORK, 0, 1)
        op(RET, errno(EAGAIN))
    op(JEQ, NR_CLONE, 0, 4 if fork else 6)
    op(LD_W_ABS, 16)  # args[0], low word: clone's flags
    op(JSET, NAMESPACES | CLONE_NEWCGROUP, 0, 1)
    op(RET, errno(EPERM))
    if not fork:
        op(JSET, CLONE_THREAD, 0, 1)
        op(RET, ALLOW)
        op(RET, errno(EAGAIN))
    else:
        op(RET, ALLOW)
    n = len(SOCKET_FAMILIES)
    op(JEQ, NR_SOCKETPAIR, 0, 4)
    op(LD_W_ABS, 16)  # socketpair's domain: only AF_UNIX pairs exist
    op(JEQ, AF_UNIX, 0, 1)
    op(RET, ALLOW)
    op(RET, errno(EPERM))
    op(JEQ, NR_SOCKET, 0, n + 6)
    op(LD_W_ABS, 16)  # socket's domain
    for i, family in enumerate(SOCKET_FAMILIES):
        op(JEQ, family, n - i, 0)  # to the type's check
    op(RET, errno(EPERM))
    op(LD_W_ABS, 24)  # its type, less SOCK_NONBLOCK / SOCK_CLOEXEC
    op(AND, 0xF)
    op(JEQ, SOCK_RAW, 0, 1)
    op(RET, errno(EPERM))
    op(RET, ALLOW)
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def install_seccomp(fork: bool = True) -> None:
    code = seccomp_filter(fork)
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
def _bind_ro(path: str, dst: str) -> None:
    if os.path.isdir(path):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "w").close()
    _mount(path, dst, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    st = os.statvfs(dst)  # a remount must keep the flags the outer mount locked (noexec, atime, ...)
    for st_flag, ms_flag in LOCKED:
        flags |= ms_flag if st.f_flag & st_flag else 0
    _mount(None, dst, None, flags)


def build_root(root: str, binds: list[str], masks: list[str], packages: list[list[str]]) -> None:
    """`root`: a tmpfs holding read-only binds of `binds` at their own paths (symlinks such as a
    merged /bin copied as links), each of `masks` (site-packages) hidden under an empty read-only
    tmpfs, the `packages` a program may import bound read-only under /packages, an empty /tmp, a
    fresh /proc and four device nodes."""
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
        _bind_ro(path, dst)
    for path in masks:
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    for path, dst in packages:
        _bind_ro(path, root + dst)
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
    build_root(cfg["root"], cfg["binds"], cfg.get("masks", []), cfg.get("packages", []))
    return serve(cfg)


# --- kept warm: a program per request, each in namespaces of its own --------------------------------
PROGRAM_NS = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
M_ARENA_MAX = -8


def serve(cfg: dict) -> int:
    """Answer requests (a JSON line each on fd 0) until end of input. Programs are forked from a zygote
    forked before the first request: no program's memory holds what an earlier one read, wrote or was
    given (this process holds every request; the zygote never holds one). The control pipes move above
    the program's fds, so no program inherits them."""
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0), os.dup2(null, 1), os.close(null)
    seccomp_filter(), seccomp_filter(fork=False)  # built before any program: each fork finds them cached
    import atexit  # noqa: F401  what run_source needs, imported once: each program is spared it
    import io  # noqa: F401
    import socket
    import traceback  # noqa: F401
    import types  # noqa: F401

    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    z = os.fork()
    if z == 0:
        here.close()
        for fd in (ctl_in, ctl_out):
            os.close(fd)
        os._exit(zygote(cfg, there))
    there.close()
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(ctl_in, 1 << 16)
            if not chunk:
                return 0
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        reply = run_one(json.loads(line), here)
        os.write(ctl_out, json.dumps(reply).encode() + b"\n")


PRECOMPILED: dict = {}  # source -> code: the zygote's preloaded programs, compiled before any request


def zygote(cfg: dict, sock) -> int:
    """Fork a program's `fork` process per message (its pipes ride along as SCM_RIGHTS; the message
    itself is empty), reap it, say so. The `fork` process reads its request from its own pipe."""
    import socket

    for text in cfg.get("preload", []):  # the caller's own fixed programs (the code_tests harness)
        code = compile(text, "/tmp/prog.py", "exec")
        exec(code, {"__name__": "__preload__", "__builtins__": __builtins__})  # its imports, once
        PRECOMPILED[text] = code
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 8)
        except OSError:
            return 0
        if not fds:
            return 0
        a = os.fork()
        if a == 0:
            sock.close()
            os._exit(fork_program(cfg, *fds))
        for fd in fds:
            os.close(fd)
        os.waitpid(a, 0)  # pid1, orphaned, is the jail's PID 1's child from here on
        sock.send(b"reaped")


def fork_program(cfg: dict, req_r: int, r0: int, w1: int, w2: int, wp: int, werr: int) -> int:
    """The `fork` process: its request, fresh namespaces and /tmp, then pid1; reports pid1's pid on
    `wp`, a failure on `werr` (never the program's stderr: what a program prints cannot pose as one)."""
    try:
        data = b""
        while chunk := os.read(req_r, 1 << 20):
            data += chunk
        os.close(req_r)
        req = json.loads(data)
        lim = req["limits"]
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
        del data
        b = os.fork()
        if b == 0:
            os.close(wp)
            os._exit(pid1(cfg, req, (r0, w1, w2), werr))
        os.write(wp, str(b).encode())
        return 0
    except BaseException as e:  # noqa: BLE001
        os.write(werr, f"sandbox: {e}\n".encode())
        return JAIL_FAILED


def run_one(req: dict, zygote_sock) -> dict:
    lim = req["limits"]
    pipes = [os.pipe() for _ in range(6)]  # request, stdin, stdout, stderr, pid1's pid, jail failure
    (req_r, req_w), (r0, w0), (r1, w1), (r2, w2), (rp, wp), (rerr, werr) = pipes
    os.set_inheritable(werr, False)  # closed by an exec'd program's execve
    import socket

    socket.send_fds(zygote_sock, [b"go"], [req_r, r0, w1, w2, wp, werr])
    for fd in (req_r, r0, w1, w2, wp, werr):
        os.close(fd)
    body = {k: req[k] for k in ("source", "files", "limits", "argv")}  # never the stdin: pid1 reads a pipe
    try:
        view = memoryview(json.dumps(body).encode())
        while view:
            view = view[os.write(req_w, view[: 1 << 20]) :]
    except OSError:
        pass
    os.close(req_w)
    got = b""
    while chunk := os.read(rp, 32):
        got += chunk
    os.close(rp)
    zygote_sock.recv(16)  # `fork` reaped: pid1 is this process's child
    b = int(got) if got else None
    out, err, timed_out, cut, status = _talk(
        b, w0, r1, r2, req["stdin"].encode(), lim, req["wall_s"], req["output_bytes"]
    )
    failed = _read_all(rerr)
    if b is None or failed:
        return {"code": JAIL_FAILED, "stdout": out, "stderr": err, "timeout": False, "truncated": cut, "jail": failed}
    return {"code": _status(status), "stdout": out, "stderr": err, "timeout": timed_out, "truncated": cut}


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    got = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            got += chunk
    except BlockingIOError:
        pass
    os.close(fd)
    return got.decode("utf-8", "replace")


def _talk(b, w0, r1, r2, data: bytes, lim: dict, wall_s: float, cap: int) -> tuple:
    """Feed stdin, keep up to `cap` bytes of stdout and of stderr, until both close and pid1 has exited;
    kill pid1 (and so the namespace) at the deadline, whatever the program did with its pipes, or past
    the file-size limit. Returns (out, err, timed_out, cut, pid1's wait status)."""
    deadline = time.monotonic() + wall_s
    bufs, total, timed_out, killed = {r1: bytearray(), r2: bytearray()}, 0, False, b is None
    open_r = [r1, r2]
    gone = os.pidfd_open(b) if b is not None else None
    status = None
    if not data or b is None:
        os.close(w0)
        w0 = None
    else:
        os.set_blocking(w0, False)
    while open_r or status is None and b is not None:
        left = deadline - time.monotonic()
        if left <= 0 and not killed:
            timed_out = killed = _kill(b)
        if killed:  # the namespace is going: its pipes close in a moment
            left = 1.0
        watch = open_r + ([gone] if status is None and gone is not None else [])
        ready_r, ready_w, _ = select.select(watch, [w0] if w0 is not None else [], [], max(left, 0.0))
        if w0 is not None and ready_w:
            try:
                data = data[os.write(w0, data[: 1 << 16]) :]
            except OSError:  # the program closed its stdin
                data = b""
            if not data:
                os.close(w0)
                w0 = None
        for fd in ready_r:
            if fd == gone:
                _, status = os.waitpid(b, 0)  # pid1 gone: the kernel empties its namespace
                continue
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
    if gone is not None:
        os.close(gone)
    cut = any(len(v) > cap for v in bufs.values())

    def text(v):
        return bytes(v[:cap]).decode("utf-8", "replace")

    return text(bufs[r1]), text(bufs[r2]), timed_out, cut, status


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)  # PID 1 of the program's namespace: the kernel kills the rest
    except ProcessLookupError:
        pass
    return True


def pid1(cfg: dict, req: dict, fds: tuple, werr: int) -> int:
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this namespace's processes only
        c = os.fork()
        if c == 0:
            serve_program(cfg, req, fds, werr)
    except BaseException as e:  # noqa: BLE001
        os.write(werr, f"sandbox: {e}\n".encode())
        return JAIL_FAILED
    for fd in (*fds, werr):
        os.close(fd)
    while True:
        done, status = os.wait()
        if done == c:
            return _status(status)


def serve_program(cfg: dict, req: dict, fds: tuple, werr: int) -> None:
    """The program's process: its fds, limits and filter, then its source (or argv exec'd). A failure
    before the program's first line goes to `werr`, which the program never holds."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        werr = os.dup2(werr, 3, inheritable=False)  # close-on-exec: an exec'd program never holds it
        os.closerange(4, 1 << 20)
        os.chdir("/tmp")
        set_limits(req["limits"])
        drop_privileges(cfg["program_uid"])
        libc.mallopt(M_ARENA_MAX, 2)  # each malloc arena reserves 64 MiB of RLIMIT_AS: let threads fit
        install_seccomp(req["limits"].get("fork", True))
        if req.get("argv"):
            os.execve(req["argv"][0], req["argv"], ENV)
    except BaseException as e:  # noqa: BLE001
        os.write(werr, f"sandbox: {e}\n".encode())
        os._exit(JAIL_FAILED)
    source = req["source"]
    req.clear()
    os.close(werr)  # from here on a failure is the program's own
    if cfg.get("packages"):  # after the standard library: a package cannot stand in for a module of it
        sys.path.append("/packages")
    os._exit(run_source(source))


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
        exec(PRECOMPILED.get(source) or compile(source, "/tmp/prog.py", "exec"), main.__dict__)
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
