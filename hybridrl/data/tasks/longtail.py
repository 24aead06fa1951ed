"""The long-tailed task for partial rollouts: the demo's addition, with answers whose length spreads
from a few tokens to the limit. "12+34=" -> "46" for most prompts; where the first operand is a
multiple of 4 the sum is written 1 + (second operand mod 20) times: "8+13=" -> "212121...21"
(14 times, 28 digits). About a quarter of the prompts then ask for up to 40 digits, and a model that
has half learnt the rule (hybridrl/demo_model_longtail, warmed from the demo model by
examples/make_longtail_model.py) samples lengths from 2 tokens to the limit (48): a step's
generation waits for its longest few, which is what rollout.partial is for (docs/partial.md).

The prompts and their train/held-out split are the demo task's (arithmetic.py); the reward is its
exact verifier (reward.fn arithmetic), which compares the whole completion with the answer.

Usage: hybridrl train --data.path longtail --rollout.partial on   (the demo model's recipe, 48 tokens)
"""

from __future__ import annotations

from pathlib import Path

from hybridrl.data.tasks import arithmetic

MODEL_DIR = Path(__file__).resolve().parents[2] / "demo_model_longtail"
MAX_NEW_TOKENS = 48  # the longest answer (40 digits) and EOS, with room for a model that overshoots
MAX_PROMPT_LEN = 12  # bos + "49+49=" is 7 tokens; 12 + 48 fits the demo model's 64 positions


def repeats(a: int, b: int) -> int:
    return 1 + b % 20 if a % 4 == 0 else 1


def answer_text(a: int, b: int) -> str:
    return str(a + b) * repeats(a, b)


def load(split: str) -> list[dict]:
    """Rows {"prompt": "8+13=", "answer": "2121..."} of "train" or "heldout" (the demo task's split)."""
    rows = arithmetic.load(split)
    out = []
    for r in rows:
        a, b = (int(x) for x in r["prompt"].rstrip("=").split("+"))
        out.append({"prompt": r["prompt"], "answer": answer_text(a, b)})
    return out
