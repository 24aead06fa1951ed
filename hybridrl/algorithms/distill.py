"""On-policy distillation's per-token signal: the student's samples scored by a teacher (algo.teacher).

    d_t = log pi_student(a_t) - log pi_teacher(a_t)        a sample of KL(pi_student || pi_teacher) at t
    A_t <- A_t - lambda * d_t                               lambda = algo.distill_coef

The sampled token's reverse KL (k1) as a per-token advantage, as slime's `apply_opd_kl_to_advantages`,
tinker's `incorporate_kl_penalty` and NeMo-RL's OPD estimator do: the policy gradient of
E[-sum_t d_t] is the reverse KL's own gradient (the score function term), so the existing losses and
their importance correction against vLLM's log-probs carry it unchanged. With algo.task_reward off the
task's advantage is 0 and the update is pure distillation. d_t is a constant of the update (it is
computed before it, from the student's log-probs of the sampling policy), as in every peer.
Derivation and the peers' knobs: docs/distillation.md.
"""

from __future__ import annotations

import torch


def token_advantages(
    adv: torch.Tensor, logp_student: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor, coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], d [B, T]): the task's advantages ([B], broadcast over a sample's tokens, or
    [B, T]) minus coef * d_t on every token that carries loss; 0 elsewhere (prompt, padding and the
    environment's tokens in a multi-turn episode, which the student did not sample)."""
    d = torch.where(mask, logp_student.float() - logp_teacher.float(), 0.0)
    tok = adv if adv.dim() == 2 else adv[:, None].expand(mask.shape)
    return torch.where(mask, tok - coef * d, 0.0), d
