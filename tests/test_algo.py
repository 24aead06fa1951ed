"""Advantages and the clipped loss against small hand-derived numbers."""
import math

import pytest
import torch

from hybridrl.algo import advantages
from kernels.ppo_loss import ppo_loss


def test_grpo_hand_derived():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    A = advantages("grpo", R)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(A[0], torch.tensor([a, -a, -a, a]), atol=1e-5, rtol=0)
    assert torch.equal(A[1], torch.zeros(4))  # no signal in a solved group


def test_dr_grpo_and_rloo_hand_derived():
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(advantages("dr_grpo", R), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # RLOO: 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(advantages("rloo", R), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))


def _loss(logp, old, adv, **kw):
    logp = torch.tensor(logp, requires_grad=True)
    loss, m = ppo_loss(logp, torch.tensor(old), torch.tensor(adv), torch.ones(len(adv)),
                       seq_ids=torch.arange(len(adv)), eps_low=0.2, eps_high=0.28, **kw)
    loss.backward()
    return float(loss), logp.grad, m


def test_clipped_surrogate_hand_derived():
    # ratios 1.5 (A=+1) and 0.5 (A=-1): both clipped, to 1.28 and 0.8:
    # L = (max(-1.5, -1.28) + max(0.5, 0.8)) / 2 = (-1.28 + 0.8) / 2 = -0.24, gradient exactly 0
    loss, grad, m = _loss([math.log(1.5), math.log(0.5)], [0.0, 0.0], [1.0, -1.0])
    assert loss == pytest.approx(-0.24, abs=1e-6)
    assert torch.equal(grad, torch.zeros(2))
    assert float(m["clip_frac_high"]) == 0.5 and float(m["clip_frac_low"]) == 0.5
    # ratios 1.1 and 0.9 are inside the clip range: L = (-1.1 + 0.9) / 2 = -0.1,
    # dL/dlogp = -A * r / 2 = [-0.55, 0.45]
    loss, grad, _ = _loss([math.log(1.1), math.log(0.9)], [0.0, 0.0], [1.0, -1.0])
    assert loss == pytest.approx(-0.1, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.55, 0.45]))


def test_dual_clip_hand_derived():
    # A = -1, ratio 5: max(5, 0.8) = 5, then dual clip min(5, 3 * 1) = 3, gradient 0
    loss, grad, _ = _loss([math.log(5.0)], [0.0], [-1.0], dual_clip=3.0)
    assert loss == pytest.approx(3.0, abs=1e-6) and float(grad[0]) == 0.0


def test_on_policy_ratio_is_one():
    # one update per rollout: old = logp.detach(), so ratio == 1 and L = -mean(A) = -(2 - 1) / 2
    loss, grad, m = _loss([-0.3, -2.0], [-0.3, -2.0], [2.0, -1.0])
    assert loss == pytest.approx(-0.5) and float(m["ratio_mean"]) == 1.0
    torch.testing.assert_close(grad, torch.tensor([-1.0, 0.5]))
