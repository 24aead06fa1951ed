"""hybridrl.kernels.ppo_loss.ppo_loss on small hand-derived numbers (derivations in the comments)."""

import math

import pytest
import torch

from hybridrl.kernels.ppo_loss import AGGREGATORS, loss_normalizer, ppo_loss

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

LN2 = math.log(2.0)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def leaf(*xs):
    return t(*xs).requires_grad_()


def test_both_clip_branches_and_zero_gradient_where_clipped():
    # logp_old = 0, so r = exp(logp). eps_low = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28].
    #   a: A=+1, r=1.5: max(-1.5, -1.28) = -1.28  clipped (high), dL/dlogp = 0
    #   b: A=-1, r=0.5: max( 0.5,  0.8 ) =  0.8   clipped (low),  dL/dlogp = 0
    #   c: A=+1, r=0.5: max(-0.5, -0.8 ) = -0.5   unclipped,      dL/dlogp = -A r = -0.5
    #   d: A=-1, r=1.5: max( 1.5,  1.28) =  1.5   unclipped,      dL/dlogp = -A r =  1.5
    #   e: A=+2, r=1  : -2                        unclipped,      dL/dlogp = -2
    # token mean over 5: (-1.28 + 0.8 - 0.5 + 1.5 - 2) / 5 = -0.296; grads / 5.
    logp = leaf(*(math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 1.0)))
    loss, m = ppo_loss(logp, torch.zeros(5), t(1, -1, 1, -1, 2), torch.ones(5), eps_low=0.2, eps_high=0.28)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.296))
    torch.testing.assert_close(logp.grad, t(0, 0, -0.1, 0.3, -0.4))
    assert logp.grad[0] == 0 and logp.grad[1] == 0  # exactly, not approximately
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(0.2))
    torch.testing.assert_close(m["clip_frac_low"], torch.tensor(0.2))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(1.0))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(1.5))


def test_dual_clip():
    # c = 3, eps 0.2/0.28, logp_old = 0:
    #   A=-1, r=4: max(4, 1.28) = 4 -> min(4, 3) = 3   dual clip active, grad 0
    #   A=-1, r=2: max(2, 1.28) = 2 -> min(2, 3) = 2   grad -A r = 2
    #   A=+1, r=4: max(-4, -1.28) = -1.28 (dual clip only for A < 0), grad 0
    # mean: (3 + 2 - 1.28) / 3 = 1.24; grads (0, 2, 0) / 3.
    logp = leaf(math.log(4), math.log(2), math.log(4))
    loss, m = ppo_loss(logp, torch.zeros(3), t(-1, -1, 1), torch.ones(3), eps_high=0.28, dual_clip=3.0)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(1.24))
    torch.testing.assert_close(logp.grad, t(0, 2 / 3, 0))
    torch.testing.assert_close(m["clip_frac_dual"], torch.tensor(1 / 3))
    with pytest.raises(ValueError):
        ppo_loss(logp, torch.zeros(3), t(-1, -1, 1), torch.ones(3), dual_clip=0.5)


# d = logp_ref - logp with logp = 0: d = ln2 and d = -ln2.
#   k1 = -d             -> (-ln2, ln2);              dk1/dlogp = +1
#   k2 = d^2 / 2        -> (ln2^2/2, ln2^2/2);       dk2/dlogp = -d = (-ln2, ln2)
#   k3 = e^d - d - 1    -> (1 - ln2, ln2 - 1/2);     dk3/dlogp = 1 - e^d = (-1, 1/2)
KL_CASES = {
    "k1": ((-LN2, LN2), (1.0, 1.0)),
    "k2": ((LN2**2 / 2, LN2**2 / 2), (-LN2, LN2)),
    "k3": ((1 - LN2, LN2 - 0.5), (-1.0, 0.5)),
}


@pytest.mark.parametrize("kl_type", list(KL_CASES))
def test_kl_estimators_by_hand(kl_type):
    (v1, v2), (g1, g2) = KL_CASES[kl_type]
    logp = leaf(0.0, 0.0)
    # A = 0 switches the policy term off; kl_coef = 0.5, token mean over 2 tokens
    loss, m = ppo_loss(logp, None, torch.zeros(2), torch.ones(2), logp_ref=t(LN2, -LN2), kl_coef=0.5, kl_type=kl_type)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.5 * (v1 + v2) / 2))
    torch.testing.assert_close(logp.grad, 0.5 * t(g1, g2) / 2)
    torch.testing.assert_close(m["kl_mean"], torch.tensor((v1 + v2) / 2))


@pytest.mark.parametrize(
    "kl_type,expected", [("k1", (-20.0, 20.0, 15.0)), ("k2", (200.0, 200.0, 112.5)), ("k3", (10.0, 10.0, 10.0))]
)
def test_kl_at_clamp_extremes(kl_type, expected):
    # d = 30 and -30 clamp to +-20 (gradient 0 beyond the clamp). k3(20) = e^20 - 21 and
    # k3(-20) = e^-20 + 19 both exceed the cap 10; d = -15 is inside the clamp but k3 = e^-15 + 14
    # is capped too, so k3 has zero gradient at all three; k1/k2 at d=-15: 15 and 112.5.
    logp = leaf(-30.0, 30.0, 15.0)
    loss, m = ppo_loss(logp, None, torch.zeros(3), torch.ones(3), logp_ref=torch.zeros(3), kl_coef=1.0, kl_type=kl_type)
    loss.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, torch.tensor(sum(expected) / 3))
    assert logp.grad[0] == 0 and logp.grad[1] == 0
    assert (logp.grad[2] == 0) == (kl_type == "k3")


def test_entropy_bonus():
    # A = 0: loss = -c_H * mean(H) = -0.1 * 1.5; dloss/dH = -0.1 / 2
    ent = leaf(1.0, 2.0)
    loss, m = ppo_loss(torch.zeros(2), None, torch.zeros(2), torch.ones(2), entropy=ent, entropy_coef=0.1)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-0.15))
    torch.testing.assert_close(ent.grad, t(-0.05, -0.05))
    torch.testing.assert_close(m["entropy_mean"], torch.tensor(1.5))


def test_tis_weight_is_detached_and_capped():
    # On-policy (logp_old = logp.detach(), r = 1), A = 1, logp = 0:
    #   token 0: w = exp(0 - ln1.5) = 1.5            -> L = -1.5, dL/dlogp = -1.5
    #   token 1: w = exp(0 - ln3)   = 3 -> cap 2     -> L = -2,   dL/dlogp = -2
    # A w that let gradient through exp(logp - rollout) would double these gradients.
    logp = leaf(0.0, 0.0)
    rollout = t(-math.log(1.5), -math.log(3.0)).requires_grad_()
    loss, m = ppo_loss(
        logp,
        None,
        torch.ones(2),
        torch.ones(2),
        logp_rollout=rollout,
        tis_cap=2.0,
        agg="seq_mean_token_sum_norm",
        seq_ids=torch.tensor([0, 1]),
        normalizer=1,
    )
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-3.5))
    torch.testing.assert_close(logp.grad, t(-1.5, -2.0))
    assert rollout.grad is None
    torch.testing.assert_close(m["tis_mean"], torch.tensor(1.75))


def test_tis_multiplies_surrogate_not_kl():
    # w = 2 (logp_old - rollout = ln2), A = 1, r = 1: w L = -2; KL k1 with d = ln2 adds -ln2 * 0.5.
    logp_old = torch.zeros(1, requires_grad=True)
    loss, _ = ppo_loss(
        torch.zeros(1),
        logp_old,
        torch.ones(1),
        torch.ones(1),
        logp_rollout=t(-LN2),
        logp_ref=t(LN2),
        kl_coef=0.5,
        kl_type="k1",
    )
    torch.testing.assert_close(loss, torch.tensor(-2.0 - 0.5 * LN2))
    assert not loss.requires_grad  # no path from logp_old (nor the weight) into the loss


def test_sequence_level_tis():
    # seq 0: old - rollout = (0.2, 0.3) -> sum 0.5 -> w = e^0.5 for both tokens
    # seq 1: (0.5, 0.6, masked 5.0) -> masked sum 1.1 -> e^1.1 = 3.004 -> cap 2
    # A = 1, r = 1, so w L = -w per token; token mean over 4 unmasked tokens.
    diff = t(0.2, 0.3, 0.5, 0.6, 5.0)
    loss, m = ppo_loss(
        torch.zeros(5),
        torch.zeros(5),
        torch.ones(5),
        t(1, 1, 1, 1, 0),
        seq_ids=torch.tensor([0, 0, 1, 1, 1]),
        logp_rollout=-diff,
        tis_cap=2.0,
        tis_level="sequence",
    )
    w0 = math.exp(0.5)
    torch.testing.assert_close(loss, torch.tensor(-(2 * w0 + 2 * 2.0) / 4))
    torch.testing.assert_close(m["tis_mean"], torch.tensor((2 * w0 + 4.0) / 4))


# r = 1 (logp = logp_old = 0), so L = -A. seq_ids (0, 0, 0, 1, 1), the last token masked:
#   token_mean:              (-1 - 2 - 3 - 4) / 4           = -2.5
#   seq_mean_token_mean:     mean(-6 / 3, -4 / 1)           = -3
#   seq_mean_token_sum_norm: -10 / (2 sequences * 3 tokens) = -10 / 6
AGG_CASES = {"token_mean": (-2.5, 4), "seq_mean_token_mean": (-3.0, 2), "seq_mean_token_sum_norm": (-10 / 6, 6)}


@pytest.mark.parametrize("agg", list(AGG_CASES))
def test_aggregation_by_hand(agg):
    value, norm = AGG_CASES[agg]
    args = (torch.zeros(5), torch.zeros(5), t(1, 2, 3, 4, 5), t(1, 1, 1, 1, 0))
    seq = torch.tensor([0, 0, 0, 1, 1])
    loss, _ = ppo_loss(*args, seq_ids=seq, agg=agg)
    torch.testing.assert_close(loss, torch.tensor(value))
    assert loss_normalizer(agg, args[3], seq) == norm
    loss, _ = ppo_loss(*args, seq_ids=seq, agg=agg, normalizer=2 * norm)  # explicit wins
    torch.testing.assert_close(loss, torch.tensor(value / 2))


def random_batch(n_seq=6, max_len=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n_seq,), generator=g)
    seq = torch.repeat_interleave(torch.arange(n_seq), lens)  # packed, ragged
    n = seq.numel()
    mask = (torch.rand(n, generator=g) > 0.3).float()
    mask[seq == 2] = 0  # one sequence with no completion tokens
    logp = (-torch.rand(n, generator=g) * 3).requires_grad_()
    ent = (torch.rand(n, generator=g) * 2).requires_grad_()
    other = {k: logp.detach() + 0.5 * torch.randn(n, generator=g) for k in ("old", "ref", "roll")}
    adv = torch.randn(n_seq, generator=g)[seq]
    return logp, ent, other, adv, mask, seq


@pytest.mark.parametrize("agg", list(AGGREGATORS))
def test_micro_batches_sum_to_full_batch(agg):
    logp, ent, o, adv, mask, seq = random_batch()
    kw = dict(
        logp_ref=o["ref"],
        logp_rollout=o["roll"],
        tis_cap=2.0,
        tis_level="sequence",
        kl_coef=0.1,
        entropy_coef=0.01,
        dual_clip=3.0,
        agg=agg,
    )
    full, _ = ppo_loss(logp, o["old"], adv, mask, seq_ids=seq, entropy=ent, **kw)
    g_full = torch.autograd.grad(full, [logp, ent])
    norm = loss_normalizer(agg, mask, seq)
    total = 0.0
    for ids in ([0, 1], [2, 3, 4], [5]):  # whole sequences per micro-batch
        sel = torch.isin(seq, torch.tensor(ids))
        o_sel = {k: v[sel] for k, v in o.items()}
        part, _ = ppo_loss(
            logp[sel],
            o_sel["old"],
            adv[sel],
            mask[sel],
            seq_ids=seq[sel],
            entropy=ent[sel],
            normalizer=norm,
            **dict(kw, logp_ref=o_sel["ref"], logp_rollout=o_sel["roll"]),
        )
        total = total + part
    torch.testing.assert_close(total, full)
    for g, gf in zip(torch.autograd.grad(total, [logp, ent]), g_full):
        torch.testing.assert_close(g, gf)


@pytest.mark.parametrize("agg", list(AGGREGATORS))
def test_masked_tokens_and_empty_batch(agg):
    logp, ent, o, adv, mask, seq = random_batch()
    garbage = torch.where(mask.bool(), logp.detach(), torch.tensor(float("nan")))
    logp2 = garbage.clone().requires_grad_()  # NaN wherever mask == 0
    kw = dict(seq_ids=seq, logp_ref=o["ref"], kl_coef=0.1, agg=agg, entropy=ent, entropy_coef=0.1)
    loss, _ = ppo_loss(logp2, o["old"], adv, mask, **kw)
    loss.backward()
    assert torch.isfinite(loss)
    assert (logp2.grad[mask == 0] == 0).all() and (ent.grad[mask == 0] == 0).all()
    assert torch.isfinite(logp2.grad).all()
    ent.grad = None
    loss, m = ppo_loss(logp, o["old"], adv, torch.zeros_like(mask), **kw)  # all masked
    loss.backward()
    assert loss == 0 and (logp.grad == 0).all()
    assert all(torch.isfinite(torch.as_tensor(v)) for v in m.values())


def test_on_policy_ratio_is_one_and_argument_checks():
    logp = leaf(-1.0, -2.0)
    loss, m = ppo_loss(logp, None, t(1.0, -1.0), torch.ones(2))
    loss.backward()
    torch.testing.assert_close(logp.grad, t(-0.5, 0.5))  # -A * r / 2 with r = 1
    assert m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0
    for bad in (
        dict(agg="nope"),
        dict(kl_type="k4", logp_ref=logp),
        dict(kl_coef=0.1),
        dict(entropy_coef=0.1),
        dict(agg="seq_mean_token_mean"),
    ):
        with pytest.raises(ValueError):
            ppo_loss(logp, None, t(1.0, -1.0), torch.ones(2), **bad)
