"""DAPO's batch shaping (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale"), as pure
functions: dynamic sampling's group filter and the per-rank share of the refilled batch, and the
soft overlong punishment. collect.py applies them; tests check them against hand-made numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch


def mixed_groups(rewards: torch.Tensor) -> torch.Tensor:
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


@dataclass
class Fill:
    kept: list[tuple[int, int]]  # (round, group) this rank trains on
    rounds: int  # generation rounds used
    kept_per_rank: list[int]  # groups with signal on each rank, before trimming
    cap_hit: bool  # the rounds ran out before the ranks had `target` groups


def fill(
    rounds: Iterable[torch.Tensor],
    target: int,
    max_rounds: int,
    *,
    dynamic: bool = True,
    rank: int = 0,
    world_size: int = 1,
    all_sum: Callable[[list[float]], list[float]] = lambda v: v,
) -> Fill:
    """DAPO dynamic sampling: pull [P, n] reward matrices from `rounds` (each pull generates a
    round) until the ranks together hold `target` groups with signal or `max_rounds` rounds ran;
    then keep this rank's share (see `shares`). `all_sum` sums a list over ranks, so every rank
    takes the same decisions. dynamic=False: one round, every group kept, nothing trimmed."""
    kept: list[tuple[int, int]] = []
    r, per_rank = 0, [0] * world_size
    for r, R in enumerate(rounds, 1):
        signal = mixed_groups(R) if dynamic else torch.ones(len(R), dtype=torch.bool)  # [P]
        kept += [(r - 1, g) for g in signal.nonzero().flatten().tolist()]
        one_hot = [0.0] * world_size
        one_hot[rank] = float(len(kept))
        per_rank = [int(k) for k in all_sum(one_hot)]
        if not dynamic or sum(per_rank) >= target or r >= max_rounds:
            break
    share = shares(per_rank, target)[rank] if dynamic else len(kept)
    return Fill(kept[:share], r, per_rank, dynamic and sum(per_rank) < target)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13, soft overlong punishment, added to the reward: 0 up to max_len - buffer tokens,
    then falling linearly to -factor at max_len (and -factor beyond, which generation never reaches).
    buffer 0 = off."""
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    over = lengths - (max_len - buffer)  # tokens into the buffer
    return torch.clamp(-over / buffer, min=-1.0, max=0.0) * factor
