"""GMPO (hybridrl/algorithms/losses/gmpo.py): hand-derived numbers, and an oracle written from the
paper's formula on padded [B, T] rows (its code's layout) against ppo_loss on flat packed tokens.
The fused pass, micro-batches and every aggregation are covered for every declared loss, gmpo
included, in test_policy_losses.py."""

import math

import pytest
import torch

from hybridrl.core import config as C, recipe
from hybridrl.kernels.ppo_loss import ppo_loss

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

LN2 = math.log(2.0)


def test_gmpo_by_hand():
    # logp_old = 0, eps 0.4 / 0.4 in log space.
    # seq 0, A = +1, log-ratios (ln 2, 0): the upper clip stops token 0 at 0.4 -> s_0 = exp((0.4 + 0) / 2) = e^0.2,
    #   L_0 = -e^0.2; token 0 gets no gradient, token 1: dL_0/dlogp = -A s_0 / 2.
    # seq 1, A = -1, log-ratios (ln 0.5, 0.1): the lower clip stops token 2 at -0.4 -> s_1 = exp(-0.15),
    #   L_1 = +e^-0.15; token 3: dL_1/dlogp = s_1 / 2.
    # seq_mean_token_mean: each token carries its L_i with weight 1 / (2 tokens * 2 sequences), so the loss is
    #   (L_0 + L_1) / 2 and a token's gradient is (2 * 1/4) * dL_i/dlogp_t.
    logp = torch.tensor([LN2, 0.0, -LN2, 0.1], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, m = ppo_loss(
        logp,
        torch.zeros(4),
        adv,
        torch.ones(4),
        seq_ids=torch.tensor([0, 0, 1, 1]),
        policy_loss="gmpo",
        eps_low=0.4,
        eps_high=0.4,
        agg="seq_mean_token_mean",
    )
    loss.backward()
    s0, s1 = math.exp(0.2), math.exp(-0.15)
    torch.testing.assert_close(loss, torch.tensor((-s0 + s1) / 2))
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -s0 / 4, 0.0, s1 / 4]))
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(0.25))  # token 0: ratio 2 > e^0.4, A > 0
    torch.testing.assert_close(m["clip_frac_low"], torch.tensor(0.25))  # token 2: ratio 0.5 < e^-0.4, A < 0


def _paper(logp, old, adv, mask, eps_low, eps_high):
    """The paper's objective on padded rows [B, T], negated: mean over sequences of -A_i * s_i with
    s_i = exp(sum_t sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t)) / |o_i|), A_i the row's mean advantage."""
    d = logp - old
    sign = torch.sign(adv)
    kept = sign * torch.min(sign * d, sign * torch.clamp(d, -eps_low, eps_high))
    n = mask.sum(-1)
    s = torch.exp((kept * mask).sum(-1) / n)
    a = (adv * mask).sum(-1) / n
    return (-a * s).mean()


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_matches_the_papers_formula(eps):
    torch.manual_seed(0)
    lens = [5, 3, 7, 1, 4]
    B, T = len(lens), max(lens)
    mask = torch.tensor([[t < n for t in range(T)] for n in lens], dtype=torch.float32)
    old = -torch.rand(B, T) * 3
    logp = (old + 0.5 * torch.randn(B, T)).requires_grad_()  # log-ratios of +-0.5: both clips active
    adv = torch.randn(B, 1).expand(B, T).contiguous()  # one advantage per sequence (grpo)
    want = _paper(logp, old, adv, mask, *eps)
    (g_want,) = torch.autograd.grad(want, logp)
    sel = mask.bool()
    flat = logp.detach()[sel].requires_grad_()
    seq_ids = torch.arange(B)[:, None].expand(B, T)[sel]
    got, _ = ppo_loss(
        flat,
        old[sel],
        adv[sel],
        torch.ones(len(flat)),
        seq_ids=seq_ids,
        policy_loss="gmpo",
        eps_low=eps[0],
        eps_high=eps[1],
        agg="seq_mean_token_mean",
    )
    (g_got,) = torch.autograd.grad(got, flat)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want[sel])
    assert (g_got == 0).any() and (g_got != 0).any()  # some tokens clipped, some not


def test_gmpo_is_declared_with_its_properties():
    """One file declared it: the config takes the name, the recipe its clip range, SP refuses it (a sequence
    ratio), Liger has none, and it takes no dual clip."""
    cfg = recipe.loss_clip(C.load(None, {"algo.policy_loss": "gmpo"}))
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (0.4, 0.4)
    assert recipe.loss_clip(C.load(None, {"algo.policy_loss": "gmpo", "algo.clip_high": 0.3})).algo.clip_high == 0.3
    for overrides, message in (
        ({"train.kernels": "liger"}, "train.kernels=liger has no gmpo"),
        ({"algo.dual_clip": 3}, "algo.policy_loss=gmpo has not"),
        ({"train.sequence_parallel_size": 2}, "algo.policy_loss=gmpo needs each sequence whole"),
    ):
        with pytest.raises(C.ConfigError, match=message):
            C.load(None, {"algo.policy_loss": "gmpo", **overrides})
    with pytest.raises(ValueError, match="gmpo takes no dual_clip"):
        ppo_loss(
            torch.zeros(2),
            None,
            torch.ones(2),
            torch.ones(2),
            seq_ids=torch.tensor([0, 0]),
            policy_loss="gmpo",
            dual_clip=3.0,
        )
