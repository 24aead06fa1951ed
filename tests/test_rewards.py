"""Rewards without the engines: the built-in verifiers, weighted terms, async and batched user
functions, and the worker pool's isolation of a reward function that raises, hangs or dies."""

import json
import os
import sys
from pathlib import Path

import pytest

from hybridrl.core.config import ConfigError, RewardConfig
from hybridrl.data.rewards import RewardError, Scorer, parse_spec
from hybridrl.data.verifiers import extract_answer, format_check, math_verify

sys.path.insert(0, str(Path(__file__).parent))  # reward_fns, for the in-process scorer
HERE = str(Path(__file__).parent)


@pytest.fixture(autouse=True)
def _workers_find_reward_fns(monkeypatch):
    # spawned workers import reward_fns too
    monkeypatch.setenv("PYTHONPATH", f"{HERE}:{os.environ.get('PYTHONPATH', '')}")


@pytest.mark.fast
@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("<think>2 halves</think><answer>1/3</answer>", "0.5", 0.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "He sold 72.\n#### 72", 1.0),  # GSM8K: '#### N' on both sides
        ("The answer is 1,000.", "1000", 1.0),
        ("first 3, then 4, so 7", "7", 1.0),  # the last number
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("no answer here", "7", 0.0),
    ],
)
def test_math_verify_equivalences(completion, answer, expected):
    assert math_verify("", completion, answer) == expected


@pytest.mark.fast
def test_extract_answer_order():
    assert extract_answer("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\frac{2}{3}"  # last box, braces balanced
    assert extract_answer("\\boxed{1") is None  # cut off mid-box: no answer (not a number from inside it)
    assert extract_answer("<answer> 12 </answer>") == "12"
    assert extract_answer("nothing") is None


@pytest.mark.fast
def test_format_check():
    assert format_check("", "<think>a\nb</think>\n<answer>4</answer>", "") == 1.0
    assert format_check("", "<answer>4</answer>", "") == 0.0
    assert format_check("", "4 then <think>", "") == 0.0
    assert format_check("", "ANSWER: 4", "", pattern=r"ANSWER: \d+") == 1.0


@pytest.mark.fast
def test_spec_weights_and_errors():
    assert parse_spec("math_verify:1.0,format:0.1") == [("math_verify", 1.0), ("format", 0.1)]
    assert parse_spec("reward_fns:misbehave") == [("reward_fns:misbehave", 1.0)]
    assert parse_spec("reward_fns:misbehave:0.5, exact_match") == [("reward_fns:misbehave", 0.5), ("exact_match", 1.0)]
    with pytest.raises(ConfigError, match="neither a built-in .* nor module:function"):
        parse_spec("math_verfy:1.0")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        Scorer(RewardConfig(fn="reward_fns:nope", workers=0))


@pytest.mark.fast
def test_weighted_combination_in_process():
    # math_verify 1.0 + format 0.5: right and formatted 1.5; right, unformatted 1.0; wrong, formatted 0.5
    s = Scorer(RewardConfig(fn="math_verify:1.0,format:0.5", workers=0))
    scores = s.score(
        ["q"] * 3,
        ["<think>.</think><answer>\\boxed{1/2}</answer>", "\\boxed{0.5}", "<think>.</think><answer>3</answer>"],
        ["0.5"] * 3,
    )
    assert scores == [1.5, 1.0, 0.5]
    assert s.counts() == {"reward_errors": 0, "reward_timeouts": 0, "reward/math_verify": 2.0, "reward/format": 2.0}


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.fast), 1])  # 1: a spawned worker
def test_async_and_batched_user_functions(workers):
    s = Scorer(RewardConfig(fn="reward_fns:async_match,reward_fns:group_rank:2", workers=workers))
    assert s.batched and [t.is_async for t in s.terms] == [True, False]
    # one group of three completions of '1+1=': async_match 1/0/0, group_rank (shortest) 1/0/0 x weight 2
    s.submit("g", "1+1=", ["2", "22", "2 2"], "2")
    assert s.wait() == {"g": [3.0, 0.0, 0.0]}
    s.close()
    s = Scorer(RewardConfig(fn="reward_fns:async_batched_len", workers=0))
    s.submit("g", "p", ["a", "abc"], "")
    assert s.wait() == {"g": [0.1, 0.3]}


def test_auto_workers_keep_fast_builtins_in_process():
    assert Scorer(RewardConfig(fn="arithmetic")).workers == 0
    assert Scorer(RewardConfig(fn="exact_match:1,format:0.1")).workers == 0
    s = Scorer(RewardConfig(fn="math_verify", workers=-1))
    assert s.workers == min(4, os.cpu_count())
    s.close()


def test_sandboxed_rewards_get_the_cores_the_engines_leave():
    """code_tests runs a CPU-bound program per sample: its pool is the node's cores less two a rank,
    shared by the ranks (an 8-GPU node with 208 cores: 24 a rank), never fewer than 2."""
    from hybridrl.data.rewards import sandbox_workers

    assert sandbox_workers(cores=208, ranks=8) == 24 and sandbox_workers(cores=2, ranks=1) == 2
    assert sandbox_workers(cores=512, ranks=1) == 32


def test_pool_isolates_raise_hang_and_death(tmp_path):
    """Two workers, 1 s timeout: the raising, hanging and dying calls score 0, are counted and
    dead-lettered; the hung and the dead worker are replaced (the pool keeps two live workers)
    and the well-behaved calls around them are scored."""
    s = Scorer(RewardConfig(fn="reward_fns:misbehave", workers=2, timeout_s=1.0), tmp_path, rank=0)
    s.step = 5
    prompts = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5=", "1+1="]
    completions = ["2", "4", "6", "8", "10", "3"]
    answers = ["2", "4", "6", "8", "10", "2"]
    scores = s.score(prompts, completions, answers)
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert s.counts() == {"reward_errors": 2, "reward_timeouts": 1}  # raise + death; the hang
    assert len(s.slots) == 2 and all(w.proc.is_alive() for w in s.slots)
    letters = [json.loads(x) for x in (tmp_path / "reward_dead_letter.jsonl").read_text().splitlines()]
    by_kind = {d["kind"]: d for d in letters}
    assert sorted(by_kind) == ["crash", "error", "timeout"] and len(letters) == 3
    assert by_kind["error"]["prompt"] == "2+2=" and "RuntimeError: verifier bug" in by_kind["error"]["error"]
    assert by_kind["timeout"]["prompt"] == "3+3=" and by_kind["timeout"]["completion"] == "6"
    assert "exit code 7" in by_kind["crash"]["error"] and by_kind["crash"]["index"] == 3
    assert all(d["step"] == 5 and d["rank"] == 0 for d in letters)
    # the replaced workers serve the next calls
    assert s.score(["1+1="], ["2"], ["2"]) == [1.0]
    s.close()


def test_on_error_raise_stops(tmp_path):
    s = Scorer(RewardConfig(fn="reward_fns:misbehave", workers=1, on_error="raise"), tmp_path)
    with pytest.raises(RewardError, match="raised on prompt '2\\+2=' .*verifier bug"):
        s.score(["2+2="], ["4"], ["4"])
    s.close()
    s = Scorer(RewardConfig(fn="reward_fns:misbehave", workers=0, on_error="raise"))
    with pytest.raises(RewardError, match="verifier bug"):
        s.score(["2+2="], ["4"], ["4"])


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.fast), 1])  # 1: a spawned worker
def test_non_finite_rewards_are_errors(tmp_path, workers):
    """A NaN, an inf or a non-number from a reward function is an error like an exception: scored 0,
    counted in reward_errors, dead-lettered with the value named. Before: NaN passed through float() and
    made every update of the run skip (loss nan), with reward_errors 0."""
    s = Scorer(RewardConfig(fn="reward_fns:not_a_number", workers=workers), tmp_path, rank=0)
    scores = s.score(["1+1=", "2+2=", "3+3=", "4+4=", "5+5="], ["2", "4", "6", "8", "10"], ["2", "4", "6", "8", "10"])
    assert scores == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert s.counts() == {"reward_errors": 4, "reward_timeouts": 0}
    letters = [json.loads(x) for x in (tmp_path / "reward_dead_letter.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in letters] == ["error"] * 4
    for d, shown in zip(letters, ["nan", "inf", "'1.0'", "None"]):
        assert f"reward reward_fns:not_a_number returned {shown}, not a finite number" in d["error"], d
    # a reward model's NaN (collect.py hands it to reject): counted and dead-lettered the same way
    s.reject("6+6=", "12", "12", "reward model rm:/m scored nan, not a finite number", {"sample": 3})
    assert s.counts()["reward_errors"] == 1 and s.wait() == {}
    s.close()
