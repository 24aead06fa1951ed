"""Hostile solutions against the code_tests reward's verdict (hybridrl/data/code_harness.py), issue 72:
each way a wrong solution scored every test on f6da8fd, as a program: it scores 0 and is counted
(`take_hostile`, the run's `reward/hostile`), and honest solutions score as before. A process per
program: the default tier."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridrl import sandbox
from hybridrl.data import code_tests

from helpers.sandbox import left_over

LIMITS = sandbox.Limits(wall_s=4, cpu_s=2, memory_mb=256, output_bytes=4096)
ROW = {"prompt": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(2, 5) == 7"]}
EVAL = {
    "prompt": "def inc(x):",
    "entry_point": "inc",
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",
}
WRONG = "\ndef add(a, b):\n    return 0\ndef inc(x):\n    return 0\n"
RIGHT = "def add(a, b):\n    return a + b\n"

# Each makes a wrong solution pass every test of the harness on f6da8fd.
HACKS = {
    "exec_patched": "import builtins\nbuiltins.exec = lambda *a, **k: None" + WRONG,
    "compile_patched": (
        "import builtins\n_c = builtins.compile\nbuiltins.compile = lambda *a, **k: _c('pass', 'x', 'exec')" + WRONG
    ),
    "serializer_patched": (
        "import json\n_d = json.dumps\n"
        "json.dumps = lambda o, *a, **k: _d([1] * len(o), *a, **k) if isinstance(o, list) else _d(o, *a, **k)" + WRONG
    ),
    "nonce_from_frames": (
        "import sys, json, os, re\nf = sys._getframe()\nwhile f is not None:\n"
        "    for k, v in list(f.f_locals.items()):\n"
        "        if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v):\n"
        "            n = len(f.f_locals.get('tests', [0, 0]))\n"
        "            print('\\n' + v + json.dumps([1] * n), flush=True)\n"
        "            os._exit(0)\n"
        "    f = f.f_back" + WRONG
    ),
    "always_equal": (
        "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Any()\ndef inc(x):\n    return Any()"
    ),
    "int_subclass_equal": (
        "class Any(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Any(0)\ndef inc(x):\n    return Any(0)"
    ),
    "expected_from_the_test_list": (
        "import gc, re\n"
        "def _answer(name, args):\n"
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, list) and o and all(isinstance(t, str) for t in o):\n"
        "            for t in o:\n"
        "                for m in re.finditer(name + r'\\((.*?)\\) == (\\S+)', t):\n"
        "                    if eval('(' + m.group(1) + ',)') == args:\n"
        "                        return eval(m.group(2))\n"
        "def add(a, b):\n    return _answer('(?:add|candidate)', (a, b))\n"
        "def inc(x):\n    return _answer('(?:inc|candidate)', (x,))"
    ),
}


def _answer(row):
    return json.dumps({"code_tests": code_tests.spec_of(row)})


@pytest.fixture(autouse=True)
def sandbox_here():
    if sandbox.available() is not None:
        pytest.fail(sandbox.available())
    code_tests.take_hostile()


@pytest.mark.parametrize("hack", sorted(HACKS))
@pytest.mark.parametrize("row", [ROW, EVAL], ids=["mbpp", "humaneval"])
def test_a_solution_cannot_compute_its_own_verdict(hack, row):
    assert code_tests.code_tests("", HACKS[hack], _answer(row)) == 0.0, hack
    assert code_tests.take_hostile() == 1, hack  # counted: reward/hostile
    right = RIGHT if row is ROW else "def inc(x):\n    return x + 1\n"
    assert code_tests.code_tests("", right, _answer(row)) == 1.0 and code_tests.take_hostile() == 0


def test_honest_solutions_score_as_before_and_are_not_counted():
    """What the verdict's boundary must still carry: tuples vs lists, sets, dicts, floats, Counter,
    namedtuples, classes the setup defines, exceptions, a helper the tests call, much printing."""
    row = {
        "prompt": "p",
        "test_setup": "import math\nclass Node:\n    def __init__(self, v):\n        self.v = v\nroot = Node(4)",
        "test_list": [
            "assert pair(1) == (1, 2) and pair(1) != [1, 2]",
            "assert set(evens([1, 2, 4])) == {2, 4} and count('aab') == {'a': 2, 'b': 1}",
            "assert math.isclose(half(1), 0.5) and half(float('inf')) == float('inf')",
            "assert value(root) == 4 and Point(1, 2).x == 1 and Point(1, 2) == (1, 2)",
            "assert len(evens(range(10))) == 5 and 4 in evens([4]) and helper() == 'h'",
            "try:\n    half('x')\nexcept TypeError:\n    pass\nelse:\n    raise AssertionError",
            "assert list(gen(3)) == [0, 1, 2] and str(Box(3)) == 'Box(3)' and Box(3).get() == 3",
        ],
    }
    program = (
        "import collections\nPoint = collections.namedtuple('Point', 'x y')\n"
        "def pair(x):\n    return (x, x + 1)\n"
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\n"
        "def count(s):\n    return collections.Counter(s)\n"
        "def half(x):\n    print('x' * 100000)\n    return x / 2\n"
        "def value(node):\n    return node.v\n"
        "def helper():\n    return 'h'\n"
        "def gen(n):\n    yield from range(n)\n"
        "class Box:\n    def __init__(self, v):\n        self.v = v\n    def get(self):\n        return self.v\n"
        "    def __str__(self):\n        return f'Box({self.v})'\n"
    )
    got = code_tests.outcomes(code_tests.spec_of(row), program)
    assert got == [1] * len(row["test_list"]) and code_tests.take_hostile() == 0


def test_a_solution_that_prints_a_lot_still_passes():
    """The harness's report no longer shares the program's stdout: 64 KiB of prints cut it off on f6da8fd."""
    loud = "def add(a, b):\n    print('x' * 200000)\n    return a + b\n"
    assert code_tests.code_tests("", loud, _answer(ROW)) == 1.0


def test_a_solution_that_hangs_keeps_the_tests_it_passed():
    slow = "import time\ndef add(a, b):\n    if a == 2:\n        time.sleep(60)\n    return a + b\n"
    t0 = time.perf_counter()
    assert code_tests.outcomes(code_tests.spec_of(ROW), slow, limits=LIMITS) == [1, 0]
    assert time.perf_counter() - t0 < LIMITS.wall_s + 2


def test_many_attacks_at_once_leave_honest_scores_alone():
    """Fork bombs, memory hogs, a closed-pipe sleeper, a vsock listener and verdict hacks in flight
    beside honest samples: the hacks score 0, each counted, honest ones score 1, and the run goes on."""
    bad = [
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))",
        "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)",
        "import socket\ns = socket.socket(40, socket.SOCK_STREAM)\ns.bind((0xFFFFFFFF, 5000))\ns.listen()",
    ]
    answer = _answer(ROW)
    jobs = [lambda s=s: sandbox.run(s, limits=LIMITS) for s in bad]
    jobs += [lambda h=h: code_tests.code_tests("", h, answer) for h in HACKS.values()]
    jobs += [lambda: code_tests.code_tests("", RIGHT, answer) for _ in range(4)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda job: job(), jobs))
    assert all(not r.ok and r.status != "jail" for r in got[: len(bad)])
    assert got[len(bad) : len(bad) + len(HACKS)] == [0.0] * len(HACKS) and got[-4:] == [1.0] * 4
    assert code_tests.take_hostile() == len(HACKS)
    time.sleep(0.2)
    assert left_over() == [] and sandbox.run("print(1)").stdout == "1\n"  # nothing left running; the run goes on


def test_the_run_logs_the_share_of_hostile_samples(tmp_path):
    """The count crosses from the reward worker to the run's metrics: `reward/hostile` (the collector
    makes it a per-sample mean)."""
    from hybridrl.core.config import RewardConfig
    from hybridrl.data.rewards import Scorer

    s = Scorer(RewardConfig(fn="code_tests", workers=1, timeout_s=30.0), tmp_path, rank=0)
    try:
        answer = _answer(ROW)
        scores = s.score(["p"] * 3, [RIGHT, HACKS["exec_patched"], HACKS["always_equal"]], [answer] * 3)
        assert scores == [1.0, 0.0, 0.0]
        assert s.counts() == {"reward_errors": 0, "reward_timeouts": 0, "reward/hostile": 2}
        assert s.counts()["reward/hostile"] == 0  # reset
    finally:
        s.close()


def test_a_solution_cannot_stand_in_for_a_module_the_tests_use():
    """MBPP's tests read modules the solution imported (`math.isclose` with no setup): the checker binds
    its own module under that name, never the solution's object (whose isclose said yes on f6da8fd)."""
    row = {"prompt": "p", "test_list": ["assert math.isclose(vol(1), 4.18879, rel_tol=1e-3)"]}
    honest = "import math\ndef vol(r):\n    return 4 / 3 * math.pi * r ** 3\n"
    assert code_tests.code_tests("", honest, _answer(row)) == 1.0
    for fake in (
        "class M:\n    def isclose(self, *a, **k):\n        return True\nmath = M()\ndef vol(r):\n    return 0\n",
        "import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\nvol = abs\n",
    ):
        assert code_tests.code_tests("", fake, _answer(row)) == 0.0


@pytest.mark.parametrize("kind", ["asserts", "io"])
def test_a_solution_starts_no_process_of_its_own(kind):
    """The harness's two processes, or a stdin/stdout row's one, are all a sample holds
    (code_tests.ceiling, which the memory plan counts): a fork in the solution fails with EAGAIN."""
    probe = (
        "import os\ndef probe():\n    try:\n        pid = os.fork()\n    except OSError as e:\n"
        "        return 'refused' if e.errno == 11 else str(e)\n    if pid == 0:\n        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n    return 'forked'\n"
    )
    if kind == "asserts":
        spec = {"kind": "asserts", "setup": "", "tests": ["assert probe() == 'refused'"]}
    else:
        probe += "print(probe())\n"
        spec = {"kind": "io", "inputs": [""], "outputs": ["refused"]}
    assert code_tests.verdict(spec, probe).outcomes == [1]
    assert code_tests.ceiling() == 2 * (code_tests.LIMITS.memory_mb << 20) + code_tests.LIMITS.tmp_bytes
