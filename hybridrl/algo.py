"""Advantage estimators: pure functions on a [prompts, n] reward matrix, chosen by name.

The loss itself (clipped surrogate, KL, aggregation) lives in kernels/ppo_loss.py.
Definitions follow ../shared/notes/LOSS_MATH.md.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (R - group mean) / (group std + eps).

    The std is torch's default unbiased estimator, as in TRL and verl, so numbers match theirs.
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [P, 1]
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + EPS)  # [P, n]


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): R - group mean; no std division (it favours easy/hard groups)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): R_i - mean of the other n-1 samples of the group."""
    n = rewards.shape[1]
    if n < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * n / (n - 1)


ADVANTAGES = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}  # name -> fn


def advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """rewards [P, n] -> advantages [P, n]. Groups with equal rewards get exactly 0."""
    return ADVANTAGES[name](rewards.float())
