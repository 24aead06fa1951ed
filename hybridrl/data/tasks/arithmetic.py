"""Two-number addition, the embedded demo task: "12+34=" -> "46", operands 0..49.

There are 50 * 50 = 2,500 pairs. 256 of them form a fixed held-out split that never appears in
training; the other 2,244 are the train split. The model shipped in `hybridrl/demo_model/` was
warmed up on the train split only until greedy held-out accuracy reached ~20-25%, so RL has
room to show an improvement (see `examples/make_demo_model.py`).

The splits are chosen by a SHA-256 ranking of the prompt text rather than by `random.shuffle`,
so they stay fixed forever, independent of Python's RNG implementation.

Usage:
    from hybridrl.data.tasks import arithmetic
    rows = arithmetic.load("train")          # [{"prompt": "12+34=", "answer": "46"}, ...]
    arithmetic.reward("12+34=", " 46<eos>", "46")  # -> 1.0
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

MAX_OPERAND = 49  # operands are 0..MAX_OPERAND inclusive
NUM_HELDOUT = 256
EOS_TEXT = "<eos>"  # the shipped tokenizer's eos token, stripped by `verify` if present
DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "demo_model"

_SPLIT_SALT = "hybridrl-arithmetic-v1"  # changing this changes the splits: don't


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def _rank(tag: str, prompt: str) -> str:
    return hashlib.sha256(f"{_SPLIT_SALT}:{tag}:{prompt}".encode()).hexdigest()


@lru_cache(maxsize=None)
def _splits() -> dict[str, tuple[tuple[int, int], ...]]:
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    by_rank = sorted(pairs, key=lambda p: _rank("heldout", prompt_text(*p)))
    heldout = sorted(by_rank[:NUM_HELDOUT])  # sorted: easy to read, order does not matter
    train = sorted(by_rank[NUM_HELDOUT:], key=lambda p: _rank("train-order", prompt_text(*p)))
    return {"train": tuple(train), "heldout": tuple(heldout)}


def load(split: str) -> list[dict]:
    """Rows `{"prompt": "12+34=", "answer": "46"}` of "train" (2,244, fixed shuffled order)
    or "heldout" (256, sorted by (a, b))."""
    splits = _splits()
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(splits)}")
    return [{"prompt": prompt_text(a, b), "answer": answer_text(a, b)} for a, b in splits[split]]


def verify(completion: str, answer: str) -> float:
    """1.0 if the completion, without surrounding whitespace and a trailing eos, is exactly
    the answer, else 0.0. "46", " 46\\n" and "46<eos>" pass; "046", "46 7", "4 6" do not."""
    text = completion.strip()
    while text.endswith(EOS_TEXT):
        text = text[: -len(EOS_TEXT)].rstrip()
    return 1.0 if text == answer.strip() else 0.0


def reward(prompt: str, completion: str, answer: str) -> float:
    """The per-sample reward the trainer calls; the prompt is not needed for this task."""
    del prompt
    return verify(completion, answer)
