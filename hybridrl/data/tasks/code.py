"""The shipped code task: write a Python function from two of its values, scored by running it.

"f(0)=3;f(1)=7;" -> "def f(x):return 4*x+3". Each prompt gives a linear function's values at 0 and
1 (f(x) = a*x + b, a and b in 0..49); the model writes f, and the `code_tests` reward runs it in the
code sandbox against five MBPP-style asserts (f at 0, 1, 2, 3 and 10): the reward is the fraction
passed, so a program with the right b and a wrong a scores 0.2 (f(0) passes). The model never sees
an answer: only the program's behaviour is scored.

The 2,500 functions split as the demo's additions do (arithmetic.py): 256 form a fixed held-out
split, chosen by a SHA-256 ranking of the prompt, that never appears in training. The model shipped
in `hybridrl/demo_model_code/` (built by `examples/make_code_model.py`) was warmed up on the train
split's programs until ~20-25% of held-out functions passed every test, so RL has room to improve it.

Usage: hybridrl train --data.path code   (the demo model's recipe; reward.fn code_tests)
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

MAX_COEF = 49  # a and b are 0..MAX_COEF inclusive
NUM_HELDOUT = 256
POINTS = (0, 1, 2, 3, 10)  # where the tests evaluate f
MODEL_DIR = Path(__file__).resolve().parents[2] / "demo_model_code"
MAX_NEW_TOKENS = 28  # "def f(x):return 49*x+49" is 23 characters, then EOS
MAX_PROMPT_LEN = 20  # bos + "f(0)=49;f(1)=98;" is 17 tokens; 20 + 28 fits the model's 64 positions

_SPLIT_SALT = "hybridrl-code-v1"  # changing this changes the splits: don't


def prompt_text(a: int, b: int) -> str:
    return f"f(0)={b};f(1)={a + b};"


def program_text(a: int, b: int) -> str:
    """The program the warm-up teaches (one of the many that pass)."""
    return f"def f(x):return {a}*x+{b}"


def tests(a: int, b: int) -> list[str]:
    return [f"assert f({x}) == {a * x + b}" for x in POINTS]


@lru_cache(maxsize=None)
def _splits() -> dict[str, tuple[tuple[int, int], ...]]:
    def rank(tag, p):
        return hashlib.sha256(f"{_SPLIT_SALT}:{tag}:{prompt_text(*p)}".encode()).hexdigest()

    pairs = [(a, b) for a in range(MAX_COEF + 1) for b in range(MAX_COEF + 1)]
    by_rank = sorted(pairs, key=lambda p: rank("heldout", p))
    return {
        "train": tuple(sorted(by_rank[NUM_HELDOUT:], key=lambda p: rank("train-order", p))),
        "heldout": tuple(sorted(by_rank[:NUM_HELDOUT])),
    }


def load(split: str) -> list[dict]:
    """Rows {"prompt": "f(0)=3;f(1)=7;", "test_list": ["assert f(0) == 3", ...]} of "train" (2,244,
    fixed shuffled order) or "heldout" (256)."""
    splits = _splits()
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(splits)}")
    return [{"prompt": prompt_text(a, b), "test_list": tests(a, b)} for a, b in splits[split]]


def coefficients(prompt: str) -> tuple[int, int]:
    """(a, b) of a prompt of this task."""
    f0, f1 = (int(part.split("=")[1]) for part in prompt.rstrip(";").split(";"))
    return f1 - f0, f0
