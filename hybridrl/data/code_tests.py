"""The `code_tests` reward: the completion's program runs against the row's tests in the sandbox.

The program is the completion's last fenced ```python block (else its last fenced block, else the
whole completion). The reward is the fraction of tests passed (`reward.code_all_or_nothing`: 1 if
all pass, else 0). Rows carry their tests in one of the formats users have:

    {"prompt": ..., "test_list": ["assert f(1) == 2", ...], "test_setup": "import math"}   MBPP
    {"prompt": ..., "test": "def check(candidate): ...", "entry_point": "f"}              HumanEval
    {"prompt": ..., "input_output": {"inputs": ["1 2\\n"], "outputs": ["3\\n"]}}          APPS, LiveCodeBench

(MBPP's `test_setup_code` is read as `test_setup`; `input_output` may be a JSON string.) The data
loader turns them into the row's answer (`spec_of`), and refuses a malformed one at start, naming
its file and line. Each sample is one sandboxed program for assert and check tests, and one a test
case for stdin/stdout tests, whose output is compared here, outside the sandbox (tokens separated
by whitespace, as APPS' checker does).

Assert and check tests are decided where the solution cannot reach (`code_harness.py`): the sandboxed
program is a checker that forks the solution's process before it reads the tests, runs the tests in
its own interpreter and calls the solution's functions across a pipe, arguments and results crossing
as plain data, so every comparison is the checker's. Patching builtins, `exec`, `compile` or the
report's serializer, digging a nonce out of frames, an object whose `__eq__` is always true, reading
the expected values from the harness's memory: each scores what the solution's real results score,
and is counted (`take_hostile()`; the Scorer reports it as `reward/hostile`). What does not cross: an
argument the tests build from a class of their own (the setup's objects cross by name), a callable
passed to the solution, in-place changes to anything but a list, dict, set or bytearray argument.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from hybridrl import sandbox
from hybridrl.sandbox import Limits, Result, run

MAX_CASES = 16  # stdin/stdout cases run per sample: the first ones
LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=512, fork=False)
HARNESS_PROCESSES = 2  # the checker and the solution; the harness then refuses any other (no_more_processes)


def ceiling(limits: Limits = LIMITS) -> int:
    """The most memory one sample's program holds: a stdin/stdout row's one process, or the harness's
    two, each within limits.memory_mb, and its /tmp."""
    return max(limits.ceiling, HARNESS_PROCESSES * (limits.memory_mb << 20) + limits.tmp_bytes)


def spec_of(row: dict) -> dict | None:
    """The row's tests as {"kind": "asserts" | "check" | "io", ...}; None if it has none. Raises
    ValueError, saying what is wrong, for a malformed one."""
    if "test_list" in row:
        tests = row["test_list"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise ValueError("'test_list' must be a non-empty list of assert statements (strings)")
        setup = row.get("test_setup", row.get("test_setup_code", "")) or ""
        if not isinstance(setup, str):
            raise ValueError("'test_setup' must be a string of code")
        for t in tests:
            _compiles(t, "a 'test_list' entry")
        return {"kind": "asserts", "tests": tests, "setup": setup}
    if "entry_point" in row or isinstance(row.get("test"), str) and "def check" in row["test"]:
        test, entry = row.get("test"), row.get("entry_point")
        if not isinstance(test, str) or "def check" not in test:
            raise ValueError("'test' must define check(candidate) (HumanEval); give 'entry_point' too")
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError("HumanEval rows need 'entry_point', the name of the function check() is given")
        _compiles(test, "'test'")
        return {"kind": "check", "test": test, "entry_point": entry}
    if "input_output" in row:
        io = row["input_output"]
        if isinstance(io, str):
            try:
                io = json.loads(io)
            except ValueError:
                raise ValueError("'input_output' is not valid JSON") from None
        if not isinstance(io, dict) or not all(isinstance(io.get(k), list) for k in ("inputs", "outputs")):
            raise ValueError("'input_output' must hold 'inputs' and 'outputs' lists (APPS / LiveCodeBench)")
        if not io["inputs"] or len(io["inputs"]) != len(io["outputs"]):
            raise ValueError(f"'input_output' has {len(io['inputs'])} inputs and {len(io['outputs'])} outputs")

        def as_text(x):
            return x if isinstance(x, str) else "\n".join(map(str, x)) if isinstance(x, list) else str(x)

        return {
            "kind": "io",
            "inputs": [as_text(x) for x in io["inputs"]],
            "outputs": [as_text(x) for x in io["outputs"]],
        }
    return None


def _compiles(code: str, what: str) -> None:
    try:
        compile(code, "<test>", "exec")
    except SyntaxError as e:
        raise ValueError(f"{what} is not valid Python ({e.msg}, line {e.lineno})") from None


_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def program_of(completion: str) -> str:
    """The last fenced python block, else the last fenced block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    py = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return completion


HARNESS = Path(__file__).with_name("code_harness.py").read_text()
if HARNESS not in sandbox.PRELOAD:
    sandbox.PRELOAD.append(HARNESS)  # each jail compiles it, and imports what it imports, once
_HOSTILE = [0]
_LOCK = threading.Lock()


@dataclass
class Verdict:
    outcomes: list[int]  # 1 or 0 for each test
    hostile: list[str] = field(default_factory=list)  # what the solution did to reach its verdict (harness's names)


def take_hostile() -> int:
    """Samples whose program tried to reach its own verdict since the last call, in this process; resets."""
    with _LOCK:
        n, _HOSTILE[0] = _HOSTILE[0], 0
    return n


def _report(res: Result, nonce: str, n: int) -> Verdict:
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(nonce):
            try:
                got = json.loads(line[len(nonce) :])
                outcomes, hostile = got["outcomes"], got["hostile"]
            except (ValueError, KeyError, TypeError):
                break
            if isinstance(outcomes, list) and len(outcomes) == n:
                return Verdict([int(x == 1) for x in outcomes], [str(h) for h in hostile])
    return Verdict([0] * n)


def _same_output(got: str, want: str) -> bool:
    return got.split() == want.split()


def outcomes(spec: dict, program: str, limits: Limits = LIMITS) -> list[int]:
    """1 or 0 for each test of `spec` run against `program`."""
    return verdict(spec, program, limits).outcomes


def verdict(spec: dict, program: str, limits: Limits = LIMITS) -> Verdict:
    """Each test's outcome, and what the program did to reach its verdict (counted: take_hostile)."""
    if spec["kind"] == "io":
        cases = list(zip(spec["inputs"], spec["outputs"]))[:MAX_CASES]
        results = [(run(program, stdin=given, limits=limits), want) for given, want in cases]
        return Verdict([int(r.ok and _same_output(r.stdout, want)) for r, want in results])
    if spec["kind"] == "asserts":
        setup, tests = spec["setup"], spec["tests"]
    else:  # HumanEval: check(candidate) defined by the test, called on the entry point
        setup, tests = "", [spec["test"] + f"\ncheck({spec['entry_point']})"]
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "setup": setup, "tests": tests, "deadline_s": max(limits.wall_s - 1.0, 0.8 * limits.wall_s)}
    files = {"solution.py": program, "setup.py": setup}  # not secret: the tests go to the checker's stdin
    harness = replace(limits, fork=True)  # its one fork; then it lets neither process start another
    got = _report(run(HARNESS, stdin=json.dumps(job) + "\n", limits=harness, files=files), nonce, len(tests))
    if got.hostile:
        with _LOCK:
            _HOSTILE[0] += 1
    return got


def code_tests(
    prompt: str, completion: str, answer: str, *, all_or_nothing: bool = False, packages: tuple[str, ...] = ()
) -> float:
    """The fraction of the row's tests the completion's program passes (all_or_nothing: 1 or 0).
    `answer` is the row's tests as the data loader wrote them (`spec_of`, as JSON); `packages` the
    installed ones a program may import (reward.sandbox_packages)."""
    try:
        spec = json.loads(answer)["code_tests"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("code_tests: this row has no tests (test_list, test + entry_point, or input_output)") from None
    passed = outcomes(spec, program_of(completion), replace(LIMITS, packages=packages) if packages else LIMITS)
    if not passed:
        return 0.0
    return float(all(passed)) if all_or_nothing else sum(passed) / len(passed)
