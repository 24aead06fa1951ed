"""The shipped code task (data.path=code): its fixed splits, and its tests run by the code_tests
reward in the real sandbox. The demo that learns from it is the slow test at the end."""

import json

import pytest

from hybridrl.data import code_tests
from hybridrl.data.tasks import code


def test_the_splits_are_fixed_and_disjoint():
    train, held = code.load("train"), code.load("heldout")
    assert (len(train), len(held)) == (2244, 256)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert held[0] == {
        "prompt": "f(0)=21;f(1)=21;",
        "test_list": [
            "assert f(0) == 21",
            "assert f(1) == 21",
            "assert f(2) == 21",
            "assert f(3) == 21",
            "assert f(10) == 21",
        ],
    }  # a = 0, b = 21


def test_programs_are_scored_by_what_they_do():
    """The warm-up's program passes all five; the right b with a wrong a passes f(0) only; an
    equivalent program the model was never shown passes too; garbage scores 0."""
    row = code.load("heldout")[100]
    a, b = code.coefficients(row["prompt"])
    answer = json.dumps({"code_tests": code_tests.spec_of(row)})

    def score(program):
        return code_tests.code_tests(row["prompt"], program, answer)

    assert score(code.program_text(a, b)) == 1.0
    assert score(code.program_text(a + 1, b)) == pytest.approx(0.2)
    assert score(f"def f(x):\n    return sum([{a}] * x) + {b}") == 1.0
    assert score("def f(x):return )") == 0.0


def test_a_code_run_scores_programs_in_the_sandbox(tmp_path):
    """`hybridrl train --data.path code`, two steps: the demo model warmed on the task, the code_tests
    reward from its recipe, the probe's sequences within the model's 64 positions (a code row's answer
    is its tests as JSON, which the probe used to append whole: 119 tokens), and rewards in fifths:
    each program ran against five asserts."""
    from helpers.cli import train_cli

    out, steps, summary = train_cli(tmp_path / "run", "--data.path", "code", "--steps", "2")
    assert "reward.fn=code_tests" in out.stdout and summary["steps"] == 2
    assert all(s["reward_errors"] == 0 and 0 < s["reward"] < 1 for s in steps)
    assert all(s[k] * 5 == pytest.approx(round(s[k] * 5)) for s in steps for k in ("reward/p10", "reward/p90"))


@pytest.mark.slow
def test_the_code_demo_learns_from_executed_code(tmp_path):
    """The README's command at its recipe (16 prompts x 8 programs a step, lr 5e-5), 150 of its 200
    steps: the share of held-out functions whose program passes all five tests rises, and so does the
    training reward, from rewards the sandbox alone gave."""
    from helpers.cli import train_cli

    _, steps, summary = train_cli(
        tmp_path / "run",
        "--data.path",
        "code",
        "--steps",
        "150",
        "--train.prompts_per_step",
        "16",
        "--rollout.n",
        "8",
        "--train.lr",
        "5e-5",
        "--log.eval_size",
        "256",
        "--train.max_minutes",
        "0",
        timeout=3600,
    )
    before, after = summary["heldout_acc_before"], summary["heldout_acc_after"]
    # one run's end point is a noisy measure: a seed is one trajectory only on the same cores (the thread
    # count changes the update's last bits, and the trajectories part). Five runs were at 28.1%, 30.5%,
    # 32.8%, 34.4%, 35.5% at step 150 (+4.7 to +12.1 points); in the three whose metrics were kept, the
    # last 30 steps' training reward beat the first 30's by 0.045 to 0.067. The bars sit below both
    assert before == 0.234375 and after >= before + 0.03, (before, after)  # 60 / 256 at the start
    rewards = [s["reward"] for s in steps]
    first, last = sum(rewards[:30]) / 30, sum(rewards[-30:]) / 30
    assert last >= first + 0.03, (first, last)
    assert sum(s["reward_errors"] + s["reward_timeouts"] for s in steps) == 0
