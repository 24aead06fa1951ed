"""Fused LM-head log-prob/entropy kernels and the PPO-family policy loss.

    from kernels import logprob_entropy, ppo_loss, fused_logprob_ppo_loss
"""
from kernels.fused_loss import fused_logprob_ppo_loss
from kernels.logprob import logprob_entropy, logprob_entropy_reference
from kernels.ppo_loss import (AGGREGATORS, IS_CORRECTIONS, IS_LEVELS, KL_ESTIMATORS, POLICY_LOSSES,
                              importance_ratio, importance_weights, loss_normalizer, ppo_loss)

__all__ = ["logprob_entropy", "logprob_entropy_reference", "ppo_loss", "fused_logprob_ppo_loss",
           "loss_normalizer", "importance_ratio", "importance_weights", "AGGREGATORS", "IS_CORRECTIONS",
           "IS_LEVELS", "KL_ESTIMATORS", "POLICY_LOSSES"]
