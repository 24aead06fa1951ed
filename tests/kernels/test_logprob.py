"""hybridrl.kernels.logprob: the chunked torch and Triton providers against the full-logits reference.

Values AND gradients (random upstream gradients on both outputs), fp32 and bf16, shapes that are
not multiples of any block, V below one block, targets at 0 / V-1 / the last partial block.
"""

import pytest
import torch

from hybridrl.kernels import logprob as lp_mod
from hybridrl.kernels.logprob import logprob_entropy, logprob_entropy_reference

from helpers.kernels import BV, DEVICE, PROVIDERS, GemmDtypes, make

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


SHAPES = {"ragged": (37, 29, 2 * BV + 11), "tiny_vocab": (21, 19, BV // 2 + 3)}  # N, d, V
TOL = {torch.float32: dict(val=2e-5, grad=2e-5), torch.bfloat16: dict(val=2e-2, grad=2e-2)}


def run(fn, hidden, weight, bias, targets, temperature=1.0, upstream=None, **kw):
    """Outputs and gradients w.r.t. (hidden, weight[, bias]) under random upstream grads."""
    logp, ent = fn(hidden, weight, targets, temperature, bias, **kw)
    g_lp, g_ent = upstream if upstream is not None else (torch.randn_like(logp), torch.randn_like(ent))
    params = [p for p in (hidden, weight, bias) if p is not None]
    grads = torch.autograd.grad((logp * g_lp + ent * g_ent).sum(), params)
    return logp.detach(), ent.detach(), grads, (g_lp, g_ent)


def close(actual, expected, tol, what):
    expected = expected.float()
    atol = tol * max(1.0, expected.abs().max().item())  # relative to the tensor's scale
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=tol, msg=what)


def check_against_reference(provider, hidden, weight, bias, targets, temperature, tol, **kw):
    logp, ent, grads, up = run(logprob_entropy, hidden, weight, bias, targets, temperature, provider=provider, **kw)
    # the reference runs in fp32 on the same (possibly bf16-rounded) inputs: the truth to compare to
    ref_in = [None if t is None else t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    r_logp, r_ent, r_grads, _ = run(logprob_entropy_reference, *ref_in, targets, temperature, up)
    assert logp.dtype == ent.dtype == torch.float32
    close(logp, r_logp, tol["val"], "logp")
    close(ent, r_ent, tol["val"], "entropy")
    for name, g, r in zip(("hidden", "weight", "bias"), grads, r_grads):
        assert g.dtype == hidden.dtype and g.shape == r.shape
        close(g, r, tol["grad"], f"d{name}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(provider, dtype, temperature, shape, bias):
    hidden, weight, b, targets = make(*SHAPES[shape], dtype, bias=bias)
    # chunk 16 < N: several chunks plus a ragged last one in the torch path and the backward
    check_against_reference(provider, hidden, weight, b, targets, temperature, TOL[dtype], chunk_size=16)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("logit_scale,tol", [(100.0, 1e-3), (1e4, 5e-3)], ids=["peaked", "huge"])
def test_peaked_and_huge_logits(provider, logit_scale, tol):
    """Logits ~100 give near one-hot softmax; ~1e4 would overflow exp without the max shift."""
    hidden, weight, b, targets = make(24, 16, BV + 5, logit_scale=logit_scale, bias=True)
    logp, ent, grads, _ = run(logprob_entropy, hidden, weight, b, targets, 1.0, provider=provider)
    assert all(torch.isfinite(t).all() for t in (logp, ent, *grads))
    check_against_reference(provider, hidden, weight, b, targets, 1.0, dict(val=tol, grad=tol))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chunk_size_invariance(provider):
    """dW must be ACCUMULATED over token chunks; overwriting it would keep only the last chunk."""
    hidden, weight, b, targets = make(*SHAPES["ragged"], bias=True)
    up = (torch.randn(hidden.shape[0], device=DEVICE), torch.randn(hidden.shape[0], device=DEVICE))
    runs = [
        run(logprob_entropy, hidden, weight, b, targets, 0.8, up, provider=provider, chunk_size=c)
        for c in (1, 5, 16, 1000)
    ]
    for logp, ent, grads, _ in runs[1:]:
        torch.testing.assert_close(logp, runs[0][0], atol=1e-5, rtol=1e-5)
        for g, g0 in zip(grads, runs[0][2]):
            torch.testing.assert_close(g, g0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_non_contiguous_hidden_and_int32_targets(provider):
    n, d, v = SHAPES["ragged"]
    base = torch.randn(d, 2 * n, device=DEVICE, requires_grad=True)
    hidden = base.t()[::2]  # [N, d], strides (2, 2N): neither dimension is contiguous
    assert not hidden.is_contiguous()
    _, weight, b, targets = make(n, d, v)
    check_against_reference(provider, hidden, weight, b, targets, 1.0, TOL[torch.float32])
    up = (torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE))
    out64 = run(logprob_entropy, hidden, weight, b, targets, 1.0, up, provider=provider)
    out32 = run(logprob_entropy, hidden, weight, b, targets.int(), 1.0, up, provider=provider)
    torch.testing.assert_close(out32[0], out64[0], atol=0, rtol=0)
    for g32, g64 in zip(out32[2], out64[2]):
        torch.testing.assert_close(g32, g64, atol=0, rtol=0)


@pytest.mark.parametrize("provider", PROVIDERS + ["naive"])
def test_ignored_targets(provider):
    """targets < 0: logp = entropy = 0 and the row contributes no gradient at all."""
    hidden, weight, b, targets = make(*SHAPES["ragged"], bias=True)
    targets[5:12] = -100
    keep = targets >= 0
    logp, ent, grads, up = run(logprob_entropy, hidden, weight, b, targets, 1.0, provider=provider)
    assert (logp[~keep] == 0).all() and (ent[~keep] == 0).all()
    assert (grads[0][~keep] == 0).all()
    # dW and db equal those of the batch with the ignored rows removed
    sub = [hidden.detach()[keep].requires_grad_(), weight, b]
    *_, sub_grads, _ = run(logprob_entropy, *sub, targets[keep], 1.0, (up[0][keep], up[1][keep]), provider=provider)
    for g, s in zip(grads[1:], sub_grads[1:]):
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS + ["naive"])
def test_all_targets_ignored_no_nan(provider):
    hidden, weight, b, targets = make(*SHAPES["tiny_vocab"], bias=True)
    logp, ent, grads, _ = run(
        logprob_entropy, hidden, weight, b, torch.full_like(targets, -100), 1.0, provider=provider
    )
    assert (logp == 0).all() and (ent == 0).all()
    assert all((g == 0).all() for g in grads)


def test_reference_gradcheck_fp64():
    hidden, weight, b, targets = make(4, 3, 5, torch.float64, bias=True, device="cpu")
    targets[3] = 2  # make() puts -100 there; gradcheck the ignored row below instead

    def f(h, w, bb):
        logp, ent = logprob_entropy_reference(h, w, targets, 0.7, bb)
        return logp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight, b))
    targets[3] = -100
    assert torch.autograd.gradcheck(f, (hidden, weight, b))


def test_torch_provider_gradcheck_fp64():
    """The chunked autograd.Function runs in fp64 for fp64 inputs, so gradcheck applies to it too."""
    hidden, weight, b, targets = make(5, 3, 6, torch.float64, bias=True, device="cpu")

    def f(h, w, bb):
        return logprob_entropy(h, w, targets, 1.3, bb, provider="torch", chunk_size=2)

    assert torch.autograd.gradcheck(f, (hidden, weight, b))


def test_frozen_head_and_auto_provider():
    hidden, weight, _, targets = make(*SHAPES["tiny_vocab"], device="cpu")
    weight.requires_grad_(False)
    logp, ent = logprob_entropy(hidden, weight, targets)  # auto -> torch on CPU
    (g,) = torch.autograd.grad(logp.sum() + ent.sum(), [hidden])
    r_logp, r_ent = logprob_entropy_reference(hidden, weight, targets)
    (r,) = torch.autograd.grad(r_logp.sum() + r_ent.sum(), [hidden])
    torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(logprob_entropy(hidden, weight, targets)[0], r_logp.detach())


def test_backward_through_logp_only():
    """An unused entropy output reaches backward as None; that path must still be right."""
    hidden, weight, b, targets = make(*SHAPES["ragged"], bias=True, device="cpu")
    g_lp = torch.randn(hidden.shape[0])
    grads = torch.autograd.grad(
        (logprob_entropy(hidden, weight, targets, 0.9, b, chunk_size=7)[0] * g_lp).sum(), [hidden, weight, b]
    )
    refs = torch.autograd.grad(
        (logprob_entropy_reference(hidden, weight, targets, 0.9, b)[0] * g_lp).sum(), [hidden, weight, b]
    )
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_autocast_runs_the_head_in_its_dtype(provider, monkeypatch):
    """Issue 71 item 3: train.precision=amp gives the kernel float32 hidden states and a float32 head
    under bfloat16 autocast; its out= GEMMs, which autocast passes by, ran the head in float32. On a
    GPU (HEAD_IN_AUTOCAST, forced here onto the CPU) every GEMM of the forward and the backward takes
    bfloat16 (the Triton forward's GEMM is inside its kernel: its inputs are checked), the outputs
    stay float32, the gradients come back in the parameters' float32, and the values are the
    reference's under the same autocast (its F.linear autocast casts). On a CPU the head stays
    float32 under autocast (the CPU default's learning: kernels/logprob.py)."""
    hidden, weight, b, targets = make(*SHAPES["ragged"], torch.float32, bias=True, device="cpu")
    with GemmDtypes() as gemms:  # the CPU's own setting: the head in float32 under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = logprob_entropy(hidden, weight, targets, 0.7, b, provider=provider, chunk_size=16)[0]
        torch.autograd.grad(logp.sum(), (hidden, weight, b))
    assert gemms.seen and all(a == w == torch.float32 for _, a, w in gemms.seen), gemms.seen
    monkeypatch.setitem(lp_mod.HEAD_IN_AUTOCAST, "cpu", True)  # the GPU's branch, on this CPU
    up = (torch.randn(hidden.shape[0]), torch.randn(hidden.shape[0]))
    stats, grad_logits = lp_mod.BACKENDS[provider]
    given = []  # the dtypes of (hidden, weight) each chunk's forward is handed
    monkeypatch.setitem(
        lp_mod.BACKENDS, provider, (lambda h, w, *a: given.append((h.dtype, w.dtype)) or stats(h, w, *a), grad_logits)
    )
    with GemmDtypes() as gemms:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, ent = logprob_entropy(hidden, weight, targets, 0.7, b, provider=provider, chunk_size=16)
        grads = torch.autograd.grad((logp * up[0] + ent * up[1]).sum(), (hidden, weight, b))  # outside, as a trainer
    assert gemms.seen and all(a == w == torch.bfloat16 for _, a, w in gemms.seen), gemms.seen
    assert given and set(given) == {(torch.bfloat16, torch.bfloat16)}
    assert logp.dtype == ent.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.float32] * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r_logp, r_ent = logprob_entropy_reference(hidden, weight, targets, 0.7, b)
    r_grads = torch.autograd.grad((r_logp * up[0] + r_ent * up[1]).sum(), (hidden, weight, b))
    tol = TOL[torch.bfloat16]
    close(logp, r_logp.detach(), tol["val"], "logp")
    close(ent, r_ent.detach(), tol["val"], "entropy")
    for name, g, r in zip(("hidden", "weight", "bias"), grads, r_grads):
        close(g, r, tol["grad"], f"d{name}")
    with GemmDtypes() as gemms:  # no autocast: the weights' own dtype, as before
        logprob_entropy(hidden, weight, targets, 0.7, b, provider=provider, chunk_size=16)[0].sum().backward()
    assert gemms.seen and all(a == w == torch.float32 for _, a, w in gemms.seen), gemms.seen
