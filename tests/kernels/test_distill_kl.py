"""hybridrl.kernels.distill_kl: the chunked full-vocabulary divergence against an fp64 full-logits oracle.

Values and gradients (random upstream weights, masked rows) for reverse KL, forward KL and the
generalised JSD, with row and column chunks that divide nothing evenly, a teacher of another width,
and a teacher head padded past the student's vocabulary.
"""

import pytest
import torch

from hybridrl.kernels.distill_kl import distill_divergence, distill_divergence_reference

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

N, D_S, D_T, V = 29, 24, 40, 83  # tokens, student width, teacher width, vocabulary


def inputs(dtype, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, D_S, generator=g, dtype=torch.float64)
    ws = torch.randn(V, D_S, generator=g, dtype=torch.float64) * 0.3
    ht = torch.randn(N, D_T, generator=g, dtype=torch.float64)
    wt = torch.randn(V + pad, D_T, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(N, generator=g) > 0.2
    up = torch.randn(N, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (hs, ws, ht, wt)], mask, up


def value_and_grads(fn, hs, ws, ht, wt, mask, up, **kw):
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    d = fn(hs, ws, ht, wt, mask, **kw)
    dh, dw = torch.autograd.grad((d * up.to(d.dtype)).sum(), (hs, ws))
    return d.detach(), dh, dw


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5, 0.1], ids=["reverse", "forward", "jsd0.5", "jsd0.1"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_and_its_gradient_match_the_fp64_oracle(beta, temperature):
    """The kernel in fp32 against full fp64 logits: value and gradient within 1e-5 (relative to scale)."""
    (hs, ws, ht, wt), mask, up = inputs(torch.float64, pad=5)
    oracle = value_and_grads(distill_divergence_reference, hs, ws, ht, wt, mask, up, beta=beta, temperature=temperature)
    f32 = [t.float() for t in (hs, ws, ht, wt)]
    got = value_and_grads(distill_divergence, *f32, mask, up, beta=beta, temperature=temperature, rows=7, cols=13)
    for name, a, b in zip(("value", "dh", "dw"), got, oracle):
        tol = 1e-5 * max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=1e-5, msg=name)
    assert (got[0][~mask] == 0).all() and (got[1][~mask] == 0).all()  # masked rows: 0, no gradient


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
def test_the_kernel_in_fp64_is_the_oracle_and_passes_gradcheck(beta):
    (hs, ws, ht, wt), mask, up = inputs(torch.float64)
    a = value_and_grads(distill_divergence, hs, ws, ht, wt, mask, up, beta=beta, rows=5, cols=17)
    b = value_and_grads(distill_divergence_reference, hs, ws, ht, wt, mask, up, beta=beta)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
    # gradcheck perturbs every input element: a small problem (4 tokens, width 3, 11 words) in 2 x 3 chunks
    h, w, t_h, t_w = hs[:4, :3].clone(), ws[:11, :3].clone(), ht[:4], wt[:11]
    f = lambda h, w: distill_divergence(h, w, t_h, t_w, beta=beta, rows=3, cols=4)  # noqa: E731
    assert torch.autograd.gradcheck(f, (h.requires_grad_(), w.requires_grad_()))


def test_same_model_gives_zero_and_the_divergences_are_non_negative():
    """Student == teacher: every divergence is 0 (up to rounding); otherwise >= 0, and the JSD at any
    beta is bounded by the endpoints' KLs scaled as in its definition."""
    (hs, ws, ht, wt), mask, _ = inputs(torch.float64)
    for beta in (0.0, 0.4, 1.0):
        same = distill_divergence(hs, ws, hs, ws, beta=beta, rows=8, cols=16)
        assert same.abs().max() < 1e-12
        d = distill_divergence(hs, ws, ht, wt, beta=beta, rows=8, cols=16)
        assert (d >= -1e-12).all()


def test_bad_arguments_are_refused_in_one_line():
    (hs, ws, ht, wt), mask, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match="beta must be in"):
        distill_divergence(hs, ws, ht, wt, beta=1.5)
    with pytest.raises(ValueError, match="fewer than the student's"):
        distill_divergence(hs, ws, ht, wt[:10])
    with pytest.raises(ValueError, match="differ in tokens"):
        distill_divergence(hs, ws, ht[:3], wt)
