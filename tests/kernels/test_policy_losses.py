"""GSPO, GSPO-token, CISPO and masked importance sampling (kernels.ppo_loss): hand-derived numbers
(derivations in the comments), the fused pass against the unfused reference (values, metrics and
gradients, every provider), and micro-batches summing to the full batch."""

import math

import pytest
import torch

from hybridrl.kernels.fused_loss import chunks, fused_logprob_ppo_loss
from hybridrl.kernels.ppo_loss import AGGREGATORS, POLICY_LOSSES, importance_weights, loss_normalizer, ppo_loss

from helpers.kernels import PROVIDERS, assert_same, batch, both

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

LN2 = math.log(2.0)
S1 = math.sqrt(0.9)  # GSPO's ratio of sequence 1 below


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def leaf(*xs):
    return t(*xs).requires_grad_()


SEQ = torch.tensor([0, 0, 1, 1])


def test_gspo_sequence_ratio_and_sequence_clipping():
    # logp_old = 0. seq 0: log-ratios (ln 2, 0) -> s_0 = exp(ln2 / 2) = 1.414, A = +1:
    #   L_0 = max(-1.414, -1.28) = -1.28: clipped as a whole, gradient 0 on both tokens (PPO would
    #   clip only the first token and keep the second's gradient).
    # seq 1: log-ratios (ln 0.9, 0) -> s_1 = sqrt(0.9) = 0.9487, A = -1: L_1 = max(0.9487, 0.8) = 0.9487.
    # seq_mean_token_mean: every token carries its sequence's L_i with weight 1 / (n_i * S) = 1/4:
    #   loss = (-1.28 + 0.9487) / 2 = -0.1657; dL/dlogp_t (seq 1) = 2 tokens * 1/4 * (-A) * s_1 / n_1 = s_1 / 4.
    logp = leaf(LN2, 0.0, math.log(0.9), 0.0)
    loss, m = ppo_loss(
        logp,
        torch.zeros(4),
        t(1, 1, -1, -1),
        torch.ones(4),
        seq_ids=SEQ,
        policy_loss="gspo",
        eps_high=0.28,
        agg="seq_mean_token_mean",
    )
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor((-1.28 + S1) / 2))
    torch.testing.assert_close(logp.grad, t(0, 0, S1 / 4, S1 / 4))
    assert logp.grad[0] == 0 and logp.grad[1] == 0
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(0.5))  # both tokens of sequence 0
    torch.testing.assert_close(m["ratio_max"], torch.tensor(math.sqrt(2.0)))


def test_gspo_token_equals_gspo_per_sequence_and_differs_per_token():
    # Same sequences; seq 1 now has per-token advantages (-1, -3), s_1 = 0.9487 unclipped.
    # Values are equal: each token carries max(-A_t s_1, -A_t clip(s_1)) = (0.9487, 2.846).
    # GSPO: d s_1 / d logp_t = s_1 / n_1, so each seq-1 token gets sum_t' w (-A_t') s_1 / 2
    #   = 1/4 * (1 + 3) * s_1 / 2 = s_1 / 2.
    # GSPO-token: d s_1,t / d logp_t = s_1 for its own token only: 1/4 * (1, 3) * s_1.
    adv = t(1, 1, -1, -3)
    value = (-1.28 - 1.28 + S1 + 3 * S1) / 4
    grads = {"gspo": t(0, 0, S1 / 2, S1 / 2), "gspo_token": t(0, 0, S1 / 4, 3 * S1 / 4)}
    for name, expected in grads.items():
        logp = leaf(LN2, 0.0, math.log(0.9), 0.0)
        loss, _ = ppo_loss(
            logp,
            torch.zeros(4),
            adv,
            torch.ones(4),
            seq_ids=SEQ,
            policy_loss=name,
            eps_high=0.28,
            agg="seq_mean_token_mean",
        )
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(value), msg=name)
        torch.testing.assert_close(logp.grad, expected, msg=name)
    # with one advantage per sequence both give s_1 / 4 per seq-1 token (previous test)
    logp = leaf(LN2, 0.0, math.log(0.9), 0.0)
    loss, _ = ppo_loss(
        logp,
        torch.zeros(4),
        t(1, 1, -1, -1),
        torch.ones(4),
        seq_ids=SEQ,
        policy_loss="gspo_token",
        eps_high=0.28,
        agg="seq_mean_token_mean",
    )
    loss.backward()
    torch.testing.assert_close(logp.grad, t(0, 0, S1 / 4, S1 / 4))


def test_cispo_clipped_weight_is_a_stop_gradient_coefficient():
    # logp_old = 0, so r = exp(logp) = (2, 0.5, 8, 1); default bounds [1 - 1, 1 + 4] = [0, 5]:
    # w = sg(clip(r)) = (2, 0.5, 5, 1); L_t = -w A logp_t with A = (1, 1, -1, 2):
    #   (-2 ln2, -0.5 ln0.5, 5 ln8, 0) = (-1.386, 0.347, 10.397, 0); token mean / 4.
    # dL/dlogp_t = -w A / 4 = (-0.5, -0.125, 1.25, -0.5): token 0 (A > 0, r = 2 > 1.2) keeps a gradient
    # where PPO's clip zeroes it, and token 2's (A < 0, r = 8) is bounded by w <= 5 (PPO's: -A r / 4 = 2).
    logp = leaf(LN2, -LN2, 3 * LN2, 0.0)
    adv = t(1, 1, -1, 2)
    loss, m = ppo_loss(logp, torch.zeros(4), adv, torch.ones(4), policy_loss="cispo")
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor((-2 * LN2 + 0.5 * LN2 + 15 * LN2) / 4))
    torch.testing.assert_close(logp.grad, t(-0.5, -0.125, 1.25, -0.5))
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(0.25))  # r = 8 truncated at 5
    # a lower bound: cispo_clip_low 0.2 -> w >= 0.8, so token 1's weight is 0.8
    logp = leaf(LN2, -LN2, 3 * LN2, 0.0)
    loss, m = ppo_loss(logp, torch.zeros(4), adv, torch.ones(4), policy_loss="cispo", cispo_clip_low=0.2)
    loss.backward()
    torch.testing.assert_close(logp.grad, t(-0.5, -0.2, 1.25, -0.5))
    torch.testing.assert_close(m["clip_frac_low"], torch.tensor(0.25))
    ppo_logp = leaf(LN2, -LN2, 3 * LN2, 0.0)
    ppo_loss(ppo_logp, torch.zeros(4), adv, torch.ones(4))[0].backward()
    assert ppo_logp.grad[0] == 0 and ppo_logp.grad[2] == 2.0


def test_masked_importance_sampling_token_sequence_geometric():
    # On-policy (r = 1), A = 1: L_t = -w_t. old - rollout = (ln 3, ln 1.5, ln 0.25), bounds [0.5, 2]:
    #   token:     ratios (3, 1.5, 0.25) -> w = (0, 1.5, 0)         loss = -1.5 / 3 = -0.5
    #   sequence:  seq 0: 3 * 1.5 = 4.5, seq 1: 0.25 -> all masked   loss = 0
    #   geometric: seq 0: sqrt(4.5) = 2.121 (kept with high 2.5), seq 1: 0.25 -> w = (2.121, 2.121, 0)
    #              loss = -2 * 2.121 / 3
    rollout = -t(math.log(3.0), math.log(1.5), math.log(0.25))
    seq = torch.tensor([0, 0, 1])
    g = math.sqrt(4.5)
    cases = {
        ("token", 2.0): (-0.5, t(0, -0.5, 0), 0.5),
        ("sequence", 2.0): (0.0, t(0, 0, 0), 0.0),
        ("geometric", 2.5): (-2 * g / 3, t(-1 / 3 * g, -1 / 3 * g, 0), 2 * g / 3),
    }
    for (level, high), (value, grad, tis_mean) in cases.items():
        logp = leaf(0.0, 0.0, 0.0)
        loss, m = ppo_loss(
            logp,
            None,
            torch.ones(3),
            torch.ones(3),
            seq_ids=seq,
            logp_rollout=rollout,
            is_correction="mask",
            tis_level=level,
            is_mask_high=high,
        )
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor(value), msg=level)
        torch.testing.assert_close(logp.grad, grad, msg=level)
        torch.testing.assert_close(m["tis_mean"], torch.tensor(tis_mean), msg=level)
    # masked tokens stay in the normaliser: token mean over 3, not over the 1 kept token (above)


def test_chunks_cut_at_sequence_ends():
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    assert chunks(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert chunks(10, 4, seq) == [slice(0, 3), slice(3, 5), slice(5, 10)]  # the 5-token sequence whole
    assert chunks(10, 100, seq) == [slice(0, 10)]
    with pytest.raises(ValueError, match="contiguous"):
        chunks(3, 4, torch.tensor([0, 1, 0]))


def test_sequence_losses_need_seq_ids():
    for name in ("gspo", "gspo_token"):
        with pytest.raises(ValueError, match="seq_ids"):
            ppo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.ones(2), policy_loss=name)
    with pytest.raises(ValueError, match="cispo"):
        ppo_loss(torch.zeros(2), None, torch.ones(2), torch.ones(2), policy_loss="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="policy_loss"):
        ppo_loss(torch.zeros(2), None, torch.ones(2), torch.ones(2), policy_loss="grpo")


def knobs(policy_loss, correction="tis"):
    kw = dict(
        policy_loss=policy_loss,
        kl_coef=0.05,
        kl_type="k3",
        entropy_coef=0.01,
        tis_level="sequence" if correction == "tis" else "geometric",
        is_correction=correction,
    )
    if correction == "tis":
        kw["tis_cap"] = 2.0
    own = POLICY_LOSSES[policy_loss].knobs()  # each loss takes only its own hyperparameters
    if "eps_high" in own:
        kw["eps_high"] = 0.28
    if "dual_clip" in own:
        kw["dual_clip"] = 3.0
    if policy_loss == "cispo":
        kw["cispo_clip_low"] = 0.2  # both bounds active on the test's ratios
        kw["cispo_clip_high"] = 0.3
    return kw


# every loss x aggregation on the torch backend; the Triton one (slow under the CPU interpreter) shares
# the loss code, so one aggregation per loss there
CASES = [("torch", p, a) for p in POLICY_LOSSES for a in AGGREGATORS]
CASES += [(pr, p, "token_mean") for pr in PROVIDERS if pr != "torch" for p in POLICY_LOSSES]


@pytest.mark.parametrize("provider,policy_loss,agg", CASES)
def test_fused_equals_unfused(provider, policy_loss, agg):
    params, data, extras = batch()
    kw = dict(knobs(policy_loss), **extras, agg=agg)
    assert_same(*both(params, data, kw, temperature=0.7, provider=provider))


@pytest.mark.parametrize(
    "provider,policy_loss", [("torch", p) for p in POLICY_LOSSES] + [(pr, "gspo") for pr in PROVIDERS if pr != "torch"]
)
def test_fused_masked_is_on_and_off_policy(provider, policy_loss):
    params, data, extras = batch()
    # ratios old/rollout spread ~ exp(N(0, 0.3^2)) per token: bounds [0.8, 1.25] mask a good share
    kw = dict(knobs(policy_loss, "mask"), **extras, is_mask_low=0.8, is_mask_high=1.25)
    w = importance_weights(
        data["logp_old"],
        extras["logp_rollout"],
        extras["seq_ids"],
        correction="mask",
        is_mask_low=0.8,
        is_mask_high=1.25,
    )
    assert 0.2 < (w == 0).float().mean() < 0.8  # a good share of the tokens is masked
    levels = ("token", "sequence", "geometric") if provider == "torch" else ("geometric",)  # interpreter: slow
    for level in levels:
        assert_same(*both(params, data, dict(kw, tis_level=level), provider=provider))
        on = dict(data, logp_old=None)  # the weight from this chunk's own log-probs
        assert_same(*both(params, on, dict(kw, tis_level=level), provider=provider))


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo_token"])
def test_fused_per_token_advantages_and_chunk_invariance(policy_loss):
    params, data, extras = batch(device="cpu")
    data = dict(data, advantages=torch.randn(len(data["advantages"])))  # per token (reinforce_pp, gae)
    kw = dict(knobs(policy_loss), **extras, agg="seq_mean_token_mean")
    runs = [both(params, data, kw, chunk_size=c)[0] for c in (1, 7, 1000)]
    for got in runs:
        assert_same(got, runs[0], tol=1e-5)
    assert_same(*both(params, data, kw, chunk_size=1))


@pytest.mark.parametrize("policy_loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("agg", list(AGGREGATORS))
def test_micro_batches_sum_to_full_batch(policy_loss, agg):
    """Pure and fused: three micro-batches of whole sequences with the full batch's normaliser."""
    (hidden, weight, b, targets), data, extras = batch(device="cpu")
    kw = dict(
        knobs(policy_loss, "mask" if policy_loss == "cispo" else "tis"),
        agg=agg,
        logp_ref=extras["logp_ref"],
        logp_rollout=extras["logp_rollout"],
    )
    args = (data["logp_old"], data["advantages"], data["mask"])
    seq = extras["seq_ids"]
    full, *_ = fused_logprob_ppo_loss(hidden, weight, targets, *args, 0.9, b, seq_ids=seq, chunk_size=5, **kw)
    g_full = torch.autograd.grad(full, [hidden, weight, b])
    norm = loss_normalizer(agg, data["mask"], seq)
    total = 0.0
    for sl in (slice(0, 12), slice(12, 30), slice(30, len(seq))):  # sequence boundaries (6 tokens each)
        part_kw = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        part, *_ = fused_logprob_ppo_loss(
            hidden[sl],
            weight,
            targets[sl],
            *(a[sl] for a in args),
            0.9,
            b,
            seq_ids=seq[sl],
            normalizer=norm,
            chunk_size=5,
            **part_kw,
        )
        total = total + part
    torch.testing.assert_close(total, full)
    for g, gf in zip(torch.autograd.grad(total, [hidden, weight, b]), g_full):
        torch.testing.assert_close(g, gf, atol=1e-5, rtol=1e-5)
    # the pure function on the same split
    logp = (data["logp_old"] + 0.2 * torch.randn(len(seq))).requires_grad_()
    ent = torch.rand(len(seq)).requires_grad_()
    pure = ppo_loss(logp, *args, seq_ids=seq, entropy=ent, **kw)[0]
    parts = sum(
        ppo_loss(
            logp[sl],
            *(a[sl] for a in args),
            seq_ids=seq[sl],
            normalizer=norm,
            entropy=ent[sl],
            **{k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
        )[0]
        for sl in (slice(0, 12), slice(12, 30), slice(30, len(seq)))
    )
    torch.testing.assert_close(parts, pure)
    for g, gf in zip(torch.autograd.grad(parts, [logp, ent]), torch.autograd.grad(pure, [logp, ent])):
        torch.testing.assert_close(g, gf)
