"""Reward functions the reward tests load by `module:function` (this directory is put on
PYTHONPATH): well-behaved, async, batched, and ones that raise, hang or kill their process."""

import asyncio
import os
import time

from hybridrl.data.rewards import batched


def misbehave(prompt: str, completion: str, answer: str) -> float:
    """Fine on most prompts; raises, hangs forever or kills its process on three of them."""
    if prompt == "2+2=":
        raise RuntimeError("verifier bug")
    if prompt == "3+3=":
        while True:  # a verifier stuck forever (a regex backtracking, a dead socket)
            time.sleep(1)
    if prompt == "4+4=":
        os._exit(7)  # a segfaulting native extension, an OOM kill
    return float(completion.strip() == answer)


async def async_match(prompt: str, completion: str, answer: str) -> float:
    await asyncio.sleep(0.001)  # e.g. an HTTP call to a judge
    return float(completion.strip() == answer)


@batched
def group_rank(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 for the shortest completion of the group, 0 for the others: needs the whole group."""
    shortest = min(len(c) for c in completions)
    return [float(len(c) == shortest) for c in completions]


@batched
async def async_batched_len(prompts, completions, answers):
    await asyncio.sleep(0)
    return [len(c) / 10 for c in completions]


def bang(prompt: str, completion: str, answer: str) -> float:
    """1 for a completion that ends on the stop string '!' (tests/tiny_model.py's favourite token)."""
    return float(completion.endswith("!"))


def not_a_number(prompt: str, completion: str, answer: str):
    """NaN, inf, a string and None on four prompts (a verifier's 0/0, a judge's unparsed reply); else a match."""
    bad = {"1+1=": float("nan"), "2+2=": float("inf"), "3+3=": "1.0", "4+4=": None}
    return bad.get(prompt, float(completion.strip() == answer))
