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

Assert and check tests run in the program's own process, as every peer runs them: the harness
reports the outcomes behind a nonce it read from stdin before the solution ran, so printing a fake
report needs the solution to dig the nonce out of its caller's frames. A solution can still cheat an
`assert f(x) == y` with an object whose `__eq__` is always true; stdin/stdout tests have no such
hole.
"""

from __future__ import annotations

import json
import re
import secrets

from hybridrl.sandbox import Limits, Result, run

MAX_CASES = 16  # stdin/stdout cases run per sample: the first ones
LIMITS = Limits(wall_s=10, cpu_s=5, memory_mb=512)


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


HARNESS = """import json, sys
def _run():
    nonce = sys.stdin.readline().strip()
    solution, setup, tests = json.loads(sys.stdin.readline())
    sys.stdin = open("/dev/null")
    ns = {"__name__": "__main__"}
    outcomes = []
    try:
        exec(compile(setup, "setup", "exec"), ns)
        exec(compile(solution, "solution.py", "exec"), ns)
    except BaseException:
        outcomes = [0] * len(tests)
    else:
        for test in tests:
            try:
                exec(compile(test, "test", "exec"), ns)
                outcomes.append(1)
            except BaseException:
                outcomes.append(0)
    sys.stdout.flush()
    print("\\n" + nonce + json.dumps(outcomes), flush=True)
_run()
"""


def _outcomes(res: Result, nonce: str, n: int) -> list[int]:
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(nonce):
            got = json.loads(line[len(nonce) :])
            if isinstance(got, list) and len(got) == n:
                return [int(x == 1) for x in got]
    return [0] * n


def _same_output(got: str, want: str) -> bool:
    return got.split() == want.split()


def outcomes(spec: dict, program: str, limits: Limits = LIMITS) -> list[int]:
    """1 or 0 for each test of `spec` run against `program`."""
    if spec["kind"] == "io":
        cases = list(zip(spec["inputs"], spec["outputs"]))[:MAX_CASES]
        results = [(run(program, stdin=given, limits=limits), want) for given, want in cases]
        return [int(r.ok and _same_output(r.stdout, want)) for r, want in results]
    if spec["kind"] == "asserts":
        setup, tests = spec["setup"], spec["tests"]
    else:  # HumanEval: check(candidate) defined by the test, called on the entry point
        setup, tests = "", [spec["test"] + f"\ncheck({spec['entry_point']})"]
    nonce = secrets.token_hex(16)
    res = run(HARNESS, stdin=nonce + "\n" + json.dumps([program, setup, tests]) + "\n", limits=limits)
    return _outcomes(res, nonce, len(tests))


def code_tests(prompt: str, completion: str, answer: str, *, all_or_nothing: bool = False) -> float:
    """The fraction of the row's tests the completion's program passes (all_or_nothing: 1 or 0).
    `answer` is the row's tests as the data loader wrote them (`spec_of`, as JSON)."""
    try:
        spec = json.loads(answer)["code_tests"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("code_tests: this row has no tests (test_list, test + entry_point, or input_output)") from None
    passed = outcomes(spec, program_of(completion))
    if not passed:
        return 0.0
    return float(all(passed)) if all_or_nothing else sum(passed) / len(passed)
