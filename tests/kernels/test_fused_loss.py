"""fused_logprob_ppo_loss == ppo_loss(*logprob_entropy_reference(...)) in value, metrics, gradients."""

import pytest
import torch

from hybridrl.kernels.fused_loss import fused_logprob_ppo_loss
from hybridrl.kernels.logprob import logprob_entropy, logprob_entropy_reference
from hybridrl.kernels.ppo_loss import AGGREGATORS, loss_normalizer, ppo_loss

from helpers.kernels import PROVIDERS, GemmDtypes, N, assert_same, batch, both

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


FULL = dict(
    tis_cap=2.0, tis_level="sequence", kl_coef=0.05, kl_type="k3", entropy_coef=0.01, dual_clip=3.0, eps_high=0.28
)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("agg", list(AGGREGATORS))
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_fused_equals_unfused(provider, agg, entropy_coef):
    params, data, extras = batch()
    kw = dict(FULL, **extras, agg=agg, entropy_coef=entropy_coef)
    assert_same(*both(params, data, kw, temperature=0.6, provider=provider))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fused_on_policy_token_tis_no_bias(provider):
    params, data, extras = batch(bias=False)
    data = dict(data, logp_old=None)  # ratio == 1; logp_old only known chunk by chunk
    kw = dict(FULL, **extras, tis_level="token")
    assert_same(*both(params, data, kw, temperature=1.3, provider=provider))
    # a sequence-level weight of the current policy: chunks are cut at sequence ends (6 tokens each,
    # chunk 8 -> slices of 6), so every sequence's log-probs are known together
    for level in ("sequence", "geometric"):
        assert_same(*both(params, data, dict(kw, tis_level=level), provider=provider))


def test_fused_bf16():
    params, data, extras = batch(dtype=torch.bfloat16)
    got, ref = both(params, data, dict(FULL, **extras))
    assert all(g.dtype == torch.bfloat16 for g in got[2])
    assert_same(got, ref, tol=3e-2)


def test_fused_chunk_size_invariance():
    params, data, extras = batch(device="cpu")
    kw = dict(FULL, **extras)
    runs = [both(params, data, kw, chunk_size=c)[0] for c in (1, 7, 1000)]
    for got in runs[1:]:
        assert_same(got, runs[0], tol=1e-5)


@pytest.mark.parametrize("agg", list(AGGREGATORS))
def test_fused_micro_batches_sum_to_full_batch(agg):
    (hidden, weight, b, targets), data, extras = batch(device="cpu")
    kw = dict(FULL, agg=agg, logp_ref=extras["logp_ref"], logp_rollout=extras["logp_rollout"])
    args = (data["logp_old"], data["advantages"], data["mask"])
    full, *_ = fused_logprob_ppo_loss(hidden, weight, targets, *args, 0.9, b, seq_ids=extras["seq_ids"], **kw)
    g_full = torch.autograd.grad(full, [hidden, weight, b])
    norm = loss_normalizer(agg, data["mask"], extras["seq_ids"])
    total = 0.0
    for sl in (slice(0, 12), slice(12, 30), slice(30, N)):  # sequence boundaries (6 tokens each)
        part_kw = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        part, *_ = fused_logprob_ppo_loss(
            hidden[sl],
            weight,
            targets[sl],
            *(a[sl] for a in args),
            0.9,
            b,
            seq_ids=extras["seq_ids"][sl],
            normalizer=norm,
            **part_kw,
        )
        total = total + part
    torch.testing.assert_close(total, full)
    for g, gf in zip(torch.autograd.grad(total, [hidden, weight, b]), g_full):
        torch.testing.assert_close(g, gf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fused_fully_masked(provider):
    params, data, extras = batch()
    data = dict(data, mask=torch.zeros_like(data["mask"]))
    (loss, metrics, grads), _ = both(params, data, dict(FULL, **extras), provider=provider)
    assert loss == 0 and all((g == 0).all() for g in grads)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_fused_upstream_scale_and_no_grad():
    """The engine's loss scale reaches dH and dW (the backward skips its multiply only at exactly 1)."""
    for dtype in (torch.bfloat16, torch.float32):
        (hidden, weight, b, targets), data, extras = batch(dtype=dtype, device="cpu")
        args = (hidden, weight, targets, data["logp_old"], data["advantages"], data["mask"], 1.0, b)
        loss, *_ = fused_logprob_ppo_loss(*args, chunk_size=8)
        g1 = torch.autograd.grad(loss, [hidden, weight])
        loss, *_ = fused_logprob_ppo_loss(*args, chunk_size=8)
        g3 = torch.autograd.grad(3.0 * loss, [hidden, weight])
        for a, c in zip(g1, g3):
            assert a.dtype == dtype and a.abs().max() > 0
            torch.testing.assert_close(
                c.float(),
                3 * a.float(),
                rtol=1e-2 if dtype == torch.bfloat16 else 1.3e-6,
                atol=0 if dtype == torch.bfloat16 else 1e-5,
            )
    with torch.no_grad():  # the float32 batch, the loop's last
        loss2, _, logp, _ = fused_logprob_ppo_loss(*args)
    torch.testing.assert_close(loss2, loss.detach())
    torch.testing.assert_close(logp, logprob_entropy(hidden, weight, targets, 1.0, b)[0].detach())
    with pytest.raises(TypeError):
        fused_logprob_ppo_loss(*args, clip_eps=0.2)


def test_fused_computes_logits_once_per_chunk(monkeypatch):
    """6*N*V*d, not 8: the fused pass builds each chunk's logits once; the unfused op twice."""
    from hybridrl.kernels import logprob as lp_mod

    calls = []
    real = lp_mod._torch_log_softmax
    monkeypatch.setattr(lp_mod, "_torch_log_softmax", lambda *a: calls.append(1) or real(*a))
    (hidden, weight, b, targets), data, _ = batch(device="cpu")  # N = 37 -> 5 chunks of 8
    loss, *_ = fused_logprob_ppo_loss(
        hidden,
        weight,
        targets,
        data["logp_old"],
        data["advantages"],
        data["mask"],
        1.0,
        b,
        provider="torch",
        chunk_size=8,
    )
    loss.backward()
    assert len(calls) == 5
    calls.clear()
    logp, ent = logprob_entropy(hidden, weight, targets, 1.0, b, provider="torch", chunk_size=8)
    (logp.sum() + ent.sum()).backward()
    assert len(calls) == 10


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fused_autocast_runs_the_head_in_its_dtype(provider, monkeypatch):
    """Issue 71 item 3, the training pass: under bfloat16 autocast over float32 weights
    (train.precision=amp) on a GPU (HEAD_IN_AUTOCAST, forced here onto the CPU) every GEMM of the
    fused pass takes bfloat16, the loss is float32, the gradients the parameters' float32, and all
    match ppo_loss over the reference under the same autocast."""
    from hybridrl.kernels import logprob as lp_mod

    monkeypatch.setitem(lp_mod.HEAD_IN_AUTOCAST, "cpu", True)
    (hidden, weight, b, targets), data, extras = batch(device="cpu")
    kw = dict(FULL, **extras)
    wrt = (hidden, weight, b)
    with GemmDtypes() as gemms:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, metrics, *_ = fused_logprob_ppo_loss(
                hidden, weight, targets, **data, temperature=0.6, bias=b, provider=provider, chunk_size=8, **kw
            )
        grads = torch.autograd.grad(loss, wrt)
    assert gemms.seen and all(a == w == torch.bfloat16 for _, a, w in gemms.seen), gemms.seen
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r_logp, r_ent = logprob_entropy_reference(hidden, weight, targets, 0.6, b)
        r_loss, r_metrics = ppo_loss(r_logp, **data, entropy=r_ent, **kw)
    r_grads = torch.autograd.grad(r_loss, wrt)
    assert_same((loss, metrics, grads), (r_loss, r_metrics, r_grads), tol=3e-2)
