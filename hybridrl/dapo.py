"""DAPO's batch shaping (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale"), as pure
functions: dynamic sampling's group filter and the per-rank share of the refilled batch, and the
soft overlong punishment. collect.py applies them; tests check them against hand-made numbers.
"""

from __future__ import annotations

import torch


def has_signal(rewards: torch.Tensor) -> torch.Tensor:
    """[P, n] rewards -> [P] bool: groups whose rewards are not all equal (all-equal groups get a
    zero advantage under GRPO/RLOO/Dr.GRPO, so they carry no gradient; DAPO eq. 11's constraint
    0 < |{correct}| < G, generalised to any reward)."""
    return (rewards != rewards[:, :1]).any(dim=1)


def shares(kept_per_rank: list[int], target: int) -> list[int]:
    """How many of its kept groups each rank trains on, so that the ranks together train on
    min(target, sum(kept)) groups, spread as evenly as their kept counts allow (one to each rank
    in turn). Every rank computes the same answer from the same all-reduced counts.

    DAPO fills one global batch and discards the surplus; with data-parallel ranks the surplus is
    taken from the ranks that have the most, so no rank idles while another trains on many."""
    out = [0] * len(kept_per_rank)
    left = min(target, sum(kept_per_rank))
    while left:
        for r, k in enumerate(kept_per_rank):
            if left and out[r] < k:
                out[r] += 1
                left -= 1
    return out


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13, soft overlong punishment, added to the reward: 0 up to max_len - buffer tokens,
    then falling linearly to -factor at max_len (and -factor beyond, which generation never reaches).
    buffer 0 = off."""
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    over = lengths - (max_len - buffer)  # tokens into the buffer
    return torch.clamp(-over / buffer, min=-1.0, max=0.0) * factor
