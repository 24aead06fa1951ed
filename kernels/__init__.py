"""Fused LM-head log-prob/entropy kernels and the PPO-family policy loss.

    from kernels import logprob_entropy, ppo_loss, fused_logprob_ppo_loss
"""
from kernels.logprob import logprob_entropy, logprob_entropy_reference
from kernels.ppo_loss import (AGGREGATORS, KL_ESTIMATORS, TIS_LEVELS, fused_logprob_ppo_loss,
                              loss_normalizer, ppo_loss)

__all__ = ["logprob_entropy", "logprob_entropy_reference", "ppo_loss", "fused_logprob_ppo_loss",
           "loss_normalizer", "AGGREGATORS", "KL_ESTIMATORS", "TIS_LEVELS"]
