"""Hostile programs against the code sandbox (hybridrl/sandbox), issue 72: one test per attack class
that worked on f6da8fd, each asserting containment (refused or cut off, nothing outside changed, the
next program runs). The verdict's attacks are tests/test_code_tests_hostile.py. A process per program:
the default tier."""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridrl import sandbox

from helpers.sandbox import left_over

LIMITS = sandbox.Limits(wall_s=4, cpu_s=2, memory_mb=256, output_bytes=4096)


@pytest.fixture(autouse=True)
def contained():
    """Nothing left running outside, and the next program runs."""
    if sandbox.available() is not None:
        pytest.fail(sandbox.available())
    yield
    time.sleep(0.2)
    assert left_over() == []
    assert sandbox.run("print(1)", limits=LIMITS).stdout == "1\n"  # the run goes on


def _memory_search(prefix: str) -> str:
    """A program that searches its own memory (every readable mapping, through ctypes: /proc/self/mem is
    closed to an undumpable process) for `prefix` and prints the 16 hex digits after each hit."""
    return (
        "import ctypes, re\nfound = set()\n"
        f"pat = re.compile(re.escape({prefix!r}.encode()) + rb'([0-9a-f]{{16}})')\n"
        "for line in open('/proc/self/maps').read().splitlines():\n"
        "    parts = line.split()\n"
        "    if not parts[1].startswith('r') or parts[-1] in ('[vvar]', '[vsyscall]', '[vvar_vclock]'):\n"
        "        continue\n"
        "    lo, hi = (int(x, 16) for x in parts[0].split('-'))\n"
        "    found.update(x.decode() for x in pat.findall(ctypes.string_at(lo, hi - lo)))\n"
        "print(sorted(found))\n"
    )


def test_a_program_cannot_read_earlier_programs_from_its_memory():
    """Source, stdin and output of the programs before it, in the same warm jail."""
    secret = os.urandom(8).hex()
    first = sandbox.run(
        f"import sys\ns = sys.stdin.read()\nprint('hybridrl-out-' + s[-16:] + '.' * 50000)\n"
        f"SRC = 'hybridrl-src-{secret}' + {'#' * 50000!r}",
        stdin="." * 50000 + "hybridrl-in-" + secret,
        limits=LIMITS,
    )
    assert first.ok, first.stderr
    res = sandbox.run(
        _memory_search("hybridrl-src-") + _memory_search("hybridrl-in-") + _memory_search("hybridrl-out-"),
        limits=sandbox.Limits(wall_s=20, cpu_s=10),
    )
    assert res.ok, res.stderr
    assert secret not in res.stdout, res.stdout


def test_processes_are_limited_per_program_however_many_run_at_once():
    """RLIMIT_NPROC counts per user namespace: 4 programs at once at processes=8 reached 7, 15, 31 and
    63 forks on f6da8fd (each one's limit was raised by the processes the others held)."""
    src = (
        "import os, sys, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\n"
        "print(n, flush=True)\ntime.sleep(3)"
    )
    lim = sandbox.Limits(wall_s=8, cpu_s=4, memory_mb=256, processes=8)

    def one(i):
        time.sleep(0.5 * i)  # each starts while the ones before hold their children
        return sandbox.run(src, limits=lim)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    assert all(r.ok for r in got), [r.stderr for r in got]
    assert all(int(r.stdout) < lim.processes for r in got), [r.stdout for r in got]


@pytest.mark.parametrize(
    "call",
    [
        "libc.shmget(0, 1 << 30, 0o1000 | 0o600)",  # IPC_PRIVATE | IPC_CREAT, 1 GiB: outside RLIMIT_AS
        "libc.syscall(319, b'x', 0)",  # memfd_create
        "libc.socket(40, 1, 0)",  # AF_VSOCK: not network-namespaced
        "libc.socket(16, 2, 0)",  # AF_NETLINK, a datagram socket (a raw one was refused already)
        "libc.socketpair(40, 1, 0, ctypes.byref((ctypes.c_int * 2)()))",
    ],
)
def test_memory_outside_the_rlimits_and_sockets_outside_the_namespace_are_refused(call):
    res = sandbox.run(
        f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint({call}, ctypes.get_errno())", limits=LIMITS
    )
    assert res.ok and res.stdout.split()[0] == "-1", res.stdout + res.stderr


def test_a_program_that_closes_its_output_is_still_stopped_at_the_wall_clock():
    res = sandbox.run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", limits=sandbox.Limits(wall_s=1))
    assert res.status == "timeout" and res.wall_s < 3


def test_a_program_cannot_pose_as_a_sandbox_failure():
    res = sandbox.run("import sys\nsys.stderr.write('sandbox: the jail failed\\n')\nsys.exit(125)", limits=LIMITS)
    assert res.status == "error" and res.returncode == 125


def test_site_packages_are_not_visible():
    site = f"{sys.base_prefix}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    assert os.listdir(site)  # there is something to hide
    res = sandbox.run(
        f"import os, sys\nsys.path.append({site!r})\nprint(os.listdir({site!r}) if os.path.exists({site!r}) else [])\n"
        "try:\n    import pip\n    print('imported')\nexcept ImportError:\n    print('no pip')",
        limits=LIMITS,
    )
    assert res.ok and res.stdout == "[]\nno pip\n", res.stdout + res.stderr


def test_honest_threaded_code_gets_its_threads():
    """At memory_mb=1024 about 14 threads fitted in RLIMIT_AS on f6da8fd (a malloc arena each)."""
    src = (
        "import threading, time\nout = []\n"
        "ts = [threading.Thread(target=lambda: (time.sleep(0.3), out.append(sum(range(1000))))) for _ in range(24)]\n"
        "for t in ts:\n    t.start()\nfor t in ts:\n    t.join()\nprint(len(out))"
    )
    res = sandbox.run(src, limits=sandbox.Limits(wall_s=10, memory_mb=1024))
    assert res.ok and res.stdout == "24\n", res.stderr


def test_a_program_without_fork_is_one_process_and_keeps_its_threads():
    """With Limits.fork off a program's address space is all it holds: fork, vfork-style spawns and
    multiprocessing fail as at RLIMIT_NPROC (EAGAIN); threads are still made."""
    src = (
        "import os, subprocess, threading, multiprocessing\nout = []\n"
        "for name, start in [('fork', os.fork), ('spawn', lambda: subprocess.run(['/bin/true'])),\n"
        "                    ('posix_spawn', lambda: os.posix_spawn('/bin/true', ['true'], {})),\n"
        "                    ('mp', lambda: multiprocessing.get_context('fork').Process(target=print).start())]:\n"
        "    pid = None\n    try:\n        pid = start()\n        out.append(name)\n    except OSError as e:\n"
        "        assert e.errno == 11, e\n"
        "    if pid == 0:\n        os._exit(0)\n"
        "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(24)]\n"
        "for t in ts:\n    t.start()\nfor t in ts:\n    t.join()\nprint(sorted(map(str, out)))"
    )
    res = sandbox.run(src, limits=sandbox.Limits(wall_s=10, memory_mb=512, fork=False))
    assert res.ok and res.stdout == f"{sorted(map(str, range(24)))}\n", res.stdout + res.stderr
    lim = sandbox.Limits(memory_mb=512, processes=32, fork=False)
    assert lim.ceiling == (512 << 20) + lim.tmp_bytes  # what the memory plan counts for one program


def test_many_hostile_programs_at_once_hold_no_more_than_the_plan_counts(monkeypatch):
    """Eight programs at once, each forking what it can and allocating all it can: at most slots() run
    at the same time, none starts a second process, none holds more than its address space. So all of
    them together stay under slots x Limits.ceiling, the figure rewards.sandbox_bytes gives the plan."""
    monkeypatch.setenv("HYBRIDRL_SANDBOX_SLOTS", "2")
    src = (
        "import os, time\nt0 = time.monotonic()\nforks = 0\n"
        "for _ in range(64):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n    forks += 1\n"
        "held, size = [], 64 << 20\nwhile size >= 1 << 20:\n    try:\n        held.append(bytearray(size))\n"
        "    except MemoryError:\n        size //= 2\n"
        "time.sleep(0.3)\nprint(t0, time.monotonic(), forks, sum(map(len, held)))"
    )
    lim = sandbox.Limits(wall_s=20, cpu_s=8, memory_mb=256, fork=False)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: sandbox.run(src, limits=lim), range(8)))
    assert all(r.ok for r in got), [r.stderr[-300:] for r in got]
    rows = [[float(x) for x in r.stdout.split()] for r in got]
    assert all(forks == 0 and held <= lim.memory_mb << 20 for _, _, forks, held in rows), rows
    events = sorted([(t0, 1) for t0, *_ in rows] + [(t1, -1) for _, t1, *_ in rows])
    running = [sum(d for _, d in events[: i + 1]) for i in range(len(events))]
    assert max(running) <= sandbox.slots() == 2, rows


def test_a_package_is_importable_only_where_the_caller_names_it():
    """site-packages stays hidden; Limits.packages (reward.sandbox_packages) shows the named ones
    read-only under /packages, after the standard library, and nothing else of site-packages."""
    src = (
        "import numpy, os\nprint(int(numpy.arange(4).sum()), sorted(os.listdir('/packages')))\n"
        "try:\n    open(numpy.__file__, 'a')\nexcept OSError as e:\n    print(e.errno in (13, 30))\n"  # EACCES, EROFS
        "try:\n    import torch\nexcept ImportError:\n    print('no torch')"
    )
    lim = sandbox.Limits(wall_s=10, memory_mb=512, fork=False, packages=("numpy",))
    res = sandbox.run(src, limits=lim)
    assert res.ok and res.stdout == "6 ['numpy', 'numpy.libs']\nTrue\nno torch\n", res.stdout + res.stderr
    assert not sandbox.run("import numpy", limits=LIMITS).ok  # a jail without it stays without it
    with pytest.raises(ValueError, match="no such package"):
        sandbox.run("print(1)", limits=sandbox.Limits(packages=("no_such_package",)))
