"""The code sandbox (hybridrl/sandbox): hostile programs are contained and nothing outside changes.

Each test runs a program that tries one escape, in the real sandbox (namespaces, rlimits, seccomp),
and checks both what the program saw and that this process, its files and its listener are as
before. A process per program: the default tier."""

import os
import socket
import time
from pathlib import Path

import pytest

from hybridrl import sandbox

from helpers.sandbox import left_over

LIMITS = sandbox.Limits(wall_s=4, cpu_s=2, memory_mb=256, output_bytes=4096)


@pytest.fixture(autouse=True)
def nothing_left():
    if sandbox.available() is not None:
        pytest.fail(sandbox.available())
    yield
    time.sleep(0.2)
    assert left_over() == []


def test_a_program_runs_and_reads_its_input():
    res = sandbox.run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3\n")
    assert res.ok and res.stdout == "6\n" and res.stderr == ""


def test_no_network_not_even_a_listener_on_this_machine():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    res = sandbox.run(
        f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
        limits=LIMITS,
    )
    assert res.status == "error" and "connected" not in res.stdout and "unreachable" in res.stderr
    with pytest.raises(socket.timeout):
        srv.accept()
    srv.close()


def test_the_run_directory_home_and_environment_are_out_of_reach(tmp_path, monkeypatch):
    secret = tmp_path / "runs" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("s3cret")
    monkeypatch.setenv("HYBRIDRL_TEST_TOKEN", "tok-123")
    res = sandbox.run(
        f"import os\nprint(sorted(os.environ))\nprint(os.listdir('/'))\n"
        f"print(os.path.exists({str(secret)!r}), os.path.exists(os.path.expanduser('~root/.bashrc')))\n"
        f"print(open({str(secret)!r}).read())",
        limits=LIMITS,
    )
    assert res.status == "error" and "FileNotFoundError" in res.stderr
    env, root, exists = res.stdout.splitlines()
    assert "HYBRIDRL_TEST_TOKEN" not in env and "tok-123" not in res.stdout and "s3cret" not in res.stdout
    assert set(eval(root)) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "tmp", "proc", "dev", "root"}
    assert exists == "False False"


def test_nothing_is_written_outside_its_tmp(tmp_path):
    targets = ["/usr/evil", "/tmp/../evil", str(tmp_path / "evil"), "/root/evil", "/dev/evil"]
    src = (
        "import os\nfor p in %r:\n    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
        "    except OSError as e: print('refused', p, e.errno)\nopen('/tmp/mine', 'w').write('ok')\nprint('tmp ok')"
    )
    res = sandbox.run(src % targets, limits=LIMITS)
    assert res.ok and "wrote" not in res.stdout and res.stdout.endswith("tmp ok\n"), res.stdout + res.stderr
    assert not any(os.path.exists(p) for p in targets[2:] + ["/usr/evil", "/evil"])


def test_a_fork_bomb_is_contained():
    t0 = time.perf_counter()
    res = sandbox.run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", limits=LIMITS
    )
    assert res.status in ("timeout", "killed", "error") and time.perf_counter() - t0 < LIMITS.wall_s + 3


def test_unbounded_allocation_fails_inside():
    res = sandbox.run("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))", limits=LIMITS)
    assert res.status in ("error", "killed") and ("MemoryError" in res.stderr or res.returncode > 128)


def test_an_endless_loop_is_stopped_by_its_cpu_limit():
    res = sandbox.run("while True:\n    pass", limits=LIMITS)
    assert res.status in ("killed", "timeout") and res.wall_s < LIMITS.wall_s + 1


def test_a_sleeping_program_is_stopped_by_the_wall_clock():
    res = sandbox.run("import time\ntime.sleep(60)", limits=sandbox.Limits(wall_s=1))
    assert res.status == "timeout" and res.wall_s < 3


def test_a_child_that_outlives_the_program_dies_with_it():
    """setsid and a double fork: the grandchild is orphaned into the namespace, whose PID 1 exits
    with the program, and the kernel kills what is left (the autouse fixture checks none is)."""
    src = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
        "    os._exit(0)\nprint('parent done')"
    )
    res = sandbox.run(src, limits=LIMITS)
    assert res.ok and res.stdout == "parent done\n" and res.wall_s < 2


def test_it_cannot_kill_its_parents():
    res = sandbox.run(
        "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError as e:\n        print(pid, e.errno)\nprint(os.getpid())",
        limits=LIMITS,
    )
    assert res.ok and res.stdout.splitlines()[:2] == ["1 1", "1 1"]  # its parent is the namespace's PID 1: EPERM


def test_a_flood_of_output_is_capped():
    res = sandbox.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=LIMITS)
    assert res.status in ("error", "killed") and res.truncated and len(res.stdout) == LIMITS.output_bytes


@pytest.mark.parametrize("call", ["ptrace", "unshare", "mount", "raw_socket", "bpf"])
def test_filtered_system_calls_fail(call):
    src = {
        "ptrace": "libc.syscall(101, 16, 0, 0, 0)",  # PTRACE_ATTACH to PID 1
        "unshare": "libc.unshare(0x10000000)",  # a user namespace of its own
        "mount": "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
        "raw_socket": "libc.socket(17, 3, 0)",  # AF_PACKET, SOCK_RAW
        "bpf": "libc.syscall(321, 0, 0, 0)",
    }[call]
    res = sandbox.run(
        f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint({src}, ctypes.get_errno())", limits=LIMITS
    )
    assert res.ok and res.stdout == "-1 1\n", res.stdout + res.stderr  # EPERM


def test_the_python_tool_runs_the_models_code_in_the_sandbox():
    """hybridrl.PythonEnv (ReTool-style): a tool call's code runs sandboxed; what it prints, or its error,
    is the tool turn, and the episode goes on."""
    import asyncio

    import hybridrl

    env = hybridrl.PythonEnv()
    env.reset({"prompt": "What is 2**100 mod 7?", "answer": "2", "index": 0})
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(pow(2, 100, 7))"}}</tool_call>'
    msgs, reward, done, info = asyncio.run(env.step(call))
    assert msgs == [{"role": "tool", "content": "2"}] and not done and info["tools/calls"] == 1
    code = 'import os\\nprint(os.listdir(\\"/root\\"))\\n1/0'
    bad = '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'
    msgs, _, _, _ = asyncio.run(env.step(bad))
    listed = eval(msgs[0]["content"].splitlines()[0])  # /root holds the interpreter's prefix (pyenv) at most
    assert "ZeroDivisionError" in msgs[0]["content"] and set(listed) <= {".pyenv"}
    assert hybridrl.python_tool("import time\ntime.sleep(60)").endswith("[timed out after 8.0 s]")


def test_programs_see_nothing_of_each_other():
    """Jails are kept warm and reused, but each program gets its own /tmp, process tree and file
    descriptors: what one leaves (a file, a process, a sleeping child) the next never sees."""
    first = sandbox.run(
        "import os, time\nopen('/tmp/mark', 'w').write('x')\nif os.fork() == 0:\n"
        "    time.sleep(60)\nprint(os.getpid())",
        limits=LIMITS,
    )
    second = sandbox.run(
        "import os\nprint(os.path.exists('/tmp/mark'), sorted(os.listdir('/tmp')))\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(sorted(os.listdir('/proc/self/fd')))",
        limits=LIMITS,
    )
    assert first.ok and first.stdout == "2\n", first.stderr  # PID 1 is the program's own reaper
    exists, processes, fds = second.stdout.splitlines()
    assert exists == "False ['prog.py']" and processes == "[1, 2]", second.stdout
    assert eval(fds) == ["0", "1", "2", "3"]  # stdin, stdout, stderr, and listdir's own: no pipe to the jail


def test_the_left_over_check_sees_a_running_program():
    """The autouse fixture's check is not vacuous: a program still running is found."""
    import threading

    t = threading.Thread(target=sandbox.run, args=("import time\ntime.sleep(1.5)",))
    t.start()
    time.sleep(0.7)
    assert left_over()
    t.join()


def test_a_killed_callers_jail_leaves_nothing_behind():
    """A reward worker killed past its timeout cannot close its jail: the jail goes when its pipe
    closes, and its directory when the next jail starts."""
    import subprocess
    import sys
    import tempfile

    src = (
        "import os, signal\nfrom hybridrl import sandbox\nassert sandbox.run('print(1)').ok\n"
        "print(os.getpid(), flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60)
    pid = out.stdout.strip()
    assert pid.isdigit(), out.stderr
    left = list(Path(tempfile.gettempdir()).glob(f"hybridrl-sandbox-{pid}-*"))
    assert left  # what it could not close
    sandbox.shutdown()
    assert sandbox.run("print(1)").ok  # a new jail sweeps
    assert not any(d.exists() for d in left)
