"""Kernel inputs and the fused-vs-reference comparison (tests/kernels/). Imported after
tests/kernels/conftest.py has set TRITON_INTERPRET on a machine without a GPU."""

import torch

from hybridrl.kernels import logprob as lp_mod
from hybridrl.kernels.fused_loss import fused_logprob_ppo_loss
from hybridrl.kernels.logprob import logprob_entropy_reference
from hybridrl.kernels.ppo_loss import ppo_loss

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton under TRITON_INTERPRET on CPU


PROVIDERS = ["torch"] + (["triton"] if lp_mod.triton is not None else [])


BV = lp_mod.BLOCK_V


def make(n, d, v, dtype=torch.float32, logit_scale=3.0, bias=False, device=DEVICE):
    hidden = torch.randn(n, d, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, device=device) * logit_scale / d**0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, device=device) * logit_scale).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), device=device)
    last_block = (v - 1) // BV * BV  # first column of the last (partial) vocab block
    targets[:4] = torch.tensor([0, v - 1, last_block + (v - 1 - last_block) // 2, -100])
    return hidden, weight, b, targets


N, D, V = 37, 29, 75


def batch(n=N, d=D, v=V, dtype=torch.float32, bias=True, device=DEVICE):
    hidden, weight, b, targets = make(n, d, v, dtype, bias=bias, device=device)
    seq = torch.arange(n, device=device) // 6  # 7 packed sequences, the last one short
    mask = (torch.rand(n, device=device) > 0.25).float()
    mask[targets < 0] = 0
    with torch.no_grad():
        logp, _ = logprob_entropy_reference(
            hidden.float(), weight.float(), targets, 1.0, None if b is None else b.float()
        )
    noise = lambda s: logp + s * torch.randn(n, device=device)  # noqa: E731
    data = dict(logp_old=noise(0.3), advantages=torch.randn(n, device=device)[seq], mask=mask)
    extras = dict(seq_ids=seq, logp_ref=noise(0.2), logp_rollout=noise(0.1))
    return (hidden, weight, b, targets), data, extras


def both(params, data, loss_kw, temperature=1.0, provider="torch", chunk_size=8):
    """(loss, metrics, grads) of the fused path and of ppo_loss over the reference log-probs."""
    hidden, weight, b, targets = params
    wrt = [p for p in (hidden, weight, b) if p is not None]
    loss, metrics, logp, ent = fused_logprob_ppo_loss(
        hidden,
        weight,
        targets,
        data["logp_old"],
        data["advantages"],
        data["mask"],
        temperature,
        b,
        provider=provider,
        chunk_size=chunk_size,
        **loss_kw,
    )
    grads = torch.autograd.grad(loss, wrt)
    r_logp, r_ent = logprob_entropy_reference(hidden, weight, targets, temperature, b)
    r_loss, r_metrics = ppo_loss(r_logp, data["logp_old"], data["advantages"], data["mask"], entropy=r_ent, **loss_kw)
    r_grads = torch.autograd.grad(r_loss, wrt)
    torch.testing.assert_close(logp, r_logp.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent, r_ent.detach(), atol=2e-5, rtol=2e-5)
    return (loss, metrics, grads), (r_loss, r_metrics, r_grads)


def assert_same(got, ref, tol=2e-5):
    (loss, metrics, grads), (r_loss, r_metrics, r_grads) = got, ref
    torch.testing.assert_close(loss, r_loss, atol=tol, rtol=tol)
    assert metrics.keys() == r_metrics.keys()
    for k in metrics:
        torch.testing.assert_close(metrics[k], r_metrics[k], atol=tol, rtol=tol, msg=k)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g, r, atol=tol * max(1.0, r.abs().max().item()), rtol=tol)


GEMMS = ("mm", "addmm", "addmm_", "matmul", "bmm", "linear")


class GemmDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtypes of every matrix product's two matrices as ATen runs it: below autocast,
    so what a GEMM was really given (an out= or in-place form autocast passes by shows as it is)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in GEMMS:
            a, b = args[1:3] if name.startswith("addmm") else args[:2]
            self.seen.append((name, a.dtype, b.dtype))
        return func(*args, **(kwargs or {}))
