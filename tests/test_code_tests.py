"""The code_tests reward (hybridrl/data/code_tests.py): the three row formats, malformed rows refused at
start naming file:line, the program taken from the completion, and the fraction of tests passed, each
program run in the real sandbox (a process per program: the default tier)."""

import json

import pytest

from hybridrl.core.config import DataConfig
from hybridrl.data import code_tests, prompts, rewards

MBPP = {
    "prompt": "Write add(a, b).",
    "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"],
}
HUMANEVAL = {
    "prompt": "def inc(x):",
    "entry_point": "inc",
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n",
}
APPS = {
    "prompt": "Read two numbers, print their sum.",
    "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]}),
}


def _answer(row):
    return json.dumps({"code_tests": code_tests.spec_of(row)})


@pytest.mark.fast
def test_rows_in_each_format_and_the_program_in_a_completion():
    assert code_tests.spec_of(MBPP)["kind"] == "asserts" and code_tests.spec_of(HUMANEVAL)["kind"] == "check"
    assert code_tests.spec_of(APPS)["inputs"][1] == "5 5\n" and code_tests.spec_of({"prompt": "p"}) is None
    assert code_tests.spec_of({**MBPP, "test_setup_code": "import math"})["setup"] == "import math"
    text = "Here:\n```\nnot this\n```\nand\n```python\ndef f():\n    return 1\n```\ndone"
    assert code_tests.program_of(text) == "def f():\n    return 1\n"
    assert code_tests.program_of("```\nx = 1\n```") == "x = 1\n" and code_tests.program_of("x = 2") == "x = 2"


@pytest.mark.fast
@pytest.mark.parametrize(
    "row, says",
    [
        ({"prompt": "p", "test_list": []}, "'test_list' must be a non-empty list"),
        ({"prompt": "p", "test_list": ["assert f(1) =="]}, "a 'test_list' entry is not valid Python"),
        ({"prompt": "p", "test": "def check(c): pass"}, "need 'entry_point'"),
        ({"prompt": "p", "input_output": "{not json"}, "'input_output' is not valid JSON"),
        ({"prompt": "p", "input_output": {"inputs": ["1"], "outputs": []}}, "1 inputs and 0 outputs"),
    ],
)
def test_a_malformed_test_row_stops_at_start_naming_its_line(tmp_path, row, says):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(MBPP) + "\n" + json.dumps(row) + "\n")
    rows = prompts.read_rows(str(path))
    with pytest.raises(prompts.DataError, match=rf"code.jsonl:2: .*{says}"):
        prompts.encode(rows, _Tokenizer(), DataConfig(chat_template="off"), str(path))


class _Tokenizer:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": list(range(len(text.split())))}


@pytest.mark.fast
def test_a_code_row_needs_no_answer_column_its_tests_are_the_answer(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (MBPP, HUMANEVAL, APPS)) + "\n")
    got, dropped = prompts.encode(
        prompts.read_rows(str(path)), _Tokenizer(), DataConfig(chat_template="off"), str(path)
    )
    assert [json.loads(p.answer)["code_tests"]["kind"] for p in got] == ["asserts", "check", "io"]
    assert dropped == {"too_long": 0, "malformed": 0}


def test_the_reward_is_the_fraction_of_tests_passed():
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code_tests.code_tests("", good, _answer(MBPP)) == pytest.approx(2 / 3)  # the third test is wrong
    assert code_tests.code_tests("", good, _answer(MBPP), all_or_nothing=True) == 0.0
    assert code_tests.code_tests("", "def add(a, b):\n    return 3", _answer(MBPP)) == pytest.approx(1 / 3)
    assert code_tests.code_tests("", "def add(a, b) return", _answer(MBPP)) == 0.0  # a syntax error
    assert code_tests.code_tests("", "def inc(x):\n    return x + 1", _answer(HUMANEVAL)) == 1.0
    assert code_tests.code_tests("", "def inc(x):\n    return x", _answer(HUMANEVAL)) == 0.0
    summing = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_tests.code_tests("", summing, _answer(APPS)) == 1.0
    assert code_tests.code_tests("", "print(3)", _answer(APPS)) == pytest.approx(1 / 3)


def test_a_program_that_exits_early_or_prints_a_fake_report_passes_nothing():
    """The harness reports behind a nonce it read before the solution ran: exiting with status 0
    before the tests, or printing what a report looks like, scores 0."""
    for hack in (
        "import os\nos._exit(0)",
        "print('\\n' + '0' * 32 + '[1, 1, 1]')",
        "import sys\nsys.exit(0)",
        "raise SystemExit(0)",
    ):
        assert code_tests.code_tests("", hack, _answer(MBPP)) == 0.0, hack


def test_the_built_in_term_and_its_all_or_nothing_knob():
    terms = rewards.load_terms("code_tests", code_all_or_nothing=True)
    right = "def inc(x):\n    return x + 1"
    assert rewards.evaluate(terms, "", [right, "def inc(x):\n    return x"], _answer(HUMANEVAL)) == [[1.0], [0.0]]
    with pytest.raises(ValueError, match="this row has no tests"):
        code_tests.code_tests("", right, "42")


def test_the_packages_knob_lets_solutions_import_what_it_names():
    """reward.sandbox_packages: a solution using numpy passes with it named, scores 0 without; a name
    not installed stops the run at start in one line."""
    from hybridrl.core import config
    from hybridrl.core.config import ConfigError
    from hybridrl.run import preflight

    uses_numpy = "import numpy\ndef inc(x):\n    return int(numpy.int64(x) + 1)"
    for packages, want in (((), 0.0), (("numpy",), 1.0)):
        terms = rewards.load_terms("code_tests", code_packages=packages)
        assert rewards.evaluate(terms, "", [uses_numpy], _answer(HUMANEVAL)) == [[want]], packages
    cfg = config.load(None, {"reward.fn": "code_tests", "reward.sandbox_packages": "numpy, no_such_pkg"})
    assert cfg.reward.packages == ("numpy", "no_such_pkg")
    with pytest.raises(ConfigError, match=r"reward.sandbox_packages='numpy, no_such_pkg': .*'no_such_pkg'"):
        preflight.check(cfg, 1)
