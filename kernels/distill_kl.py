"""Per-token divergence between the student's and the teacher's full next-token distributions, fused
with both LM heads: on-policy distillation's exact signal (TRL's GKD family), from final hidden states.

    z_S = h_S @ W_S.T / T,  z_T = h_T @ W_T.T / T,  p = softmax(z_S),  q = softmax(z_T)
    beta = 1:     KL(p || q) = sum_v p (log p - log q)          reverse KL (mode-seeking; the default)
    beta = 0:     KL(q || p) = sum_v q (log q - log p)          forward KL
    0 < beta < 1: beta KL(q || m) + (1 - beta) KL(p || m),  m = beta q + (1 - beta) p    generalised JSD

TRL's `generalized_jsd_loss` conventions (beta=0 forward, beta=1 reverse, the mixture in between).
The gradient flows to the student's hidden states and head only (the teacher is frozen):

    reverse:  dD/dz_S = p * (log p - log q - D)
    forward:  dD/dz_S = p - q
    JSD:      dD/dz_S = p * (u - sum_v p u),  u = (1 - beta) (log p - log m)

Neither [N, V] logits tensor is held: tokens go in chunks of rows and the vocabulary in chunks of
columns; the forward makes two passes over a row chunk's vocabulary (the two log-sum-exps online,
then the divergence and the per-token sum its gradient needs), the backward one more (each column
chunk's dz_S into dh_S and dW_S), so the largest buffers are [rows, cols]. Outputs are fp32 (fp64 for
fp64 inputs). Rows with `mask` False give 0 and no gradient. `distill_divergence_reference` computes
the same from full logits with autograd: the ground truth the tests compare against.
"""

from __future__ import annotations

import math

import torch

ROW_CHUNK, COL_CHUNK = 256, 8192  # [rows, cols] fp32 buffers: 8 MiB each at these sizes


def _dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _logits(h: torch.Tensor, w: torch.Tensor, inv_t: float) -> torch.Tensor:
    # the GEMM in the inputs' dtype (bf16 on a GPU), the softmax's arithmetic in fp32 or better
    return (h @ w.t()).to(_dtype(h)).mul_(inv_t)


def _lse(h: torch.Tensor, w: torch.Tensor, inv_t: float, cols: int) -> torch.Tensor:
    """log-sum-exp over the vocabulary of h @ w.T / T, one column chunk at a time: [rows]."""
    out = None
    for j in range(0, w.shape[0], cols):
        part = torch.logsumexp(_logits(h, w[j : j + cols], inv_t), dim=1)
        out = part if out is None else torch.logaddexp(out, part)
    return out


def _terms(zs, zt, lse_s, lse_t, beta: float):
    """One column chunk's log p, p, log q, q and (JSD) log m: [rows, cols] each."""
    lp, lq = zs - lse_s[:, None], zt - lse_t[:, None]
    lm = None
    if 0.0 < beta < 1.0:
        lm = torch.logaddexp(lq + math.log(beta), lp + math.log1p(-beta))
    return lp, lp.exp(), lq, lq.exp(), lm


def _divergence_and_sum(lp, p, lq, q, lm, beta: float):
    """Per-row divergence of one column chunk and, for the JSD, its share of sum_v p u: [rows] each."""
    if beta >= 1.0:
        d = (p * (lp - lq)).sum(1)
        return d, d
    if beta <= 0.0:
        return (q * (lq - lp)).sum(1), None
    kl_pm = (p * (lp - lm)).sum(1)
    d = beta * (q * (lq - lm)).sum(1) + (1.0 - beta) * kl_pm
    return d, (1.0 - beta) * kl_pm


def _grad_z(lp, p, lq, q, lm, s, beta: float) -> torch.Tensor:
    """dD/dz_S for one column chunk, given the row's sum `s` (the divergence itself for reverse KL)."""
    if beta >= 1.0:
        return p * (lp - lq - s[:, None])
    if beta <= 0.0:
        return p - q
    return p * ((1.0 - beta) * (lp - lm) - s[:, None])


class _Divergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, ht, wt, mask, beta, temperature, rows, cols):
        inv_t = 1.0 / temperature
        n = hs.shape[0]
        d_all = hs.new_zeros(n, dtype=_dtype(hs))
        s_all = torch.zeros_like(d_all)
        lse_s_all, lse_t_all = torch.zeros_like(d_all), torch.zeros_like(d_all)
        for i in range(0, n, rows):
            hs_c, ht_c = hs[i : i + rows], ht[i : i + rows]
            lse_s, lse_t = _lse(hs_c, ws, inv_t, cols), _lse(ht_c, wt, inv_t, cols)
            d = torch.zeros_like(lse_s)
            s = torch.zeros_like(lse_s)
            for j in range(0, ws.shape[0], cols):
                terms = _terms(
                    _logits(hs_c, ws[j : j + cols], inv_t), _logits(ht_c, wt[j : j + cols], inv_t), lse_s, lse_t, beta
                )
                dd, ss = _divergence_and_sum(*terms, beta)
                d += dd
                if ss is not None:
                    s += ss
            lse_s_all[i : i + rows], lse_t_all[i : i + rows] = lse_s, lse_t
            d_all[i : i + rows], s_all[i : i + rows] = d, s
        d_all = torch.where(mask, d_all, 0.0)
        ctx.save_for_backward(hs, ws, ht, wt, mask, lse_s_all, lse_t_all, s_all)
        ctx.args = (beta, inv_t, rows, cols)
        return d_all

    @staticmethod
    def backward(ctx, g):
        hs, ws, ht, wt, mask, lse_s_all, lse_t_all, s_all = ctx.saved_tensors
        beta, inv_t, rows, cols = ctx.args
        g = torch.where(mask, g, 0.0).to(_dtype(hs))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros_like(hs, dtype=_dtype(hs)) if need_h else None
        dw = torch.zeros_like(ws, dtype=_dtype(ws)) if need_w else None
        for i in range(0, hs.shape[0], rows):
            sl = slice(i, i + rows)
            hs_c, ht_c, g_c = hs[sl], ht[sl], g[sl]
            if not bool(g_c.any()):
                continue
            for j in range(0, ws.shape[0], cols):
                cj = slice(j, j + cols)
                terms = _terms(
                    _logits(hs_c, ws[cj], inv_t), _logits(ht_c, wt[cj], inv_t), lse_s_all[sl], lse_t_all[sl], beta
                )
                gz = _grad_z(*terms, s_all[sl], beta).mul_((g_c * inv_t)[:, None])  # [rows, cols]: dloss/dlogits
                if need_h:
                    dh[sl] += gz.to(ws.dtype) @ ws[cj]
                if need_w:
                    dw[cj] += gz.t().to(hs.dtype) @ hs_c
        return (
            dh.to(hs.dtype) if need_h else None,
            dw.to(ws.dtype) if need_w else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def distill_divergence(
    hidden_s: torch.Tensor,
    weight_s: torch.Tensor,
    hidden_t: torch.Tensor,
    weight_t: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    rows: int = ROW_CHUNK,
    cols: int = COL_CHUNK,
) -> torch.Tensor:
    """[N] divergence per token (see the module's docstring) from the student's [N, D_S] hidden states
    and [V, D_S] head, and the teacher's [N, D_T] and [V', D_T] (V' >= V: rows past the student's
    vocabulary, embedding padding no tokenizer id reaches, are dropped). Gradient to the student's."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if hidden_s.shape[0] != hidden_t.shape[0]:
        raise ValueError(
            f"student and teacher hidden states differ in tokens: {hidden_s.shape[0]} vs {hidden_t.shape[0]}"
        )
    vocab = weight_s.shape[0]
    if weight_t.shape[0] < vocab:
        raise ValueError(f"the teacher's head has {weight_t.shape[0]} rows, fewer than the student's {vocab}")
    if mask is None:
        mask = torch.ones(hidden_s.shape[0], dtype=torch.bool, device=hidden_s.device)
    return _Divergence.apply(
        hidden_s, weight_s, hidden_t.detach(), weight_t[:vocab].detach(), mask, float(beta), temperature, rows, cols
    )


def distill_divergence_reference(hidden_s, weight_s, hidden_t, weight_t, mask=None, *, beta=1.0, temperature=1.0):
    """The same from full [N, V] logits with autograd (TRL's generalized_jsd_loss per token)."""
    dtype = _dtype(hidden_s)
    vocab = weight_s.shape[0]
    lp = torch.log_softmax((hidden_s @ weight_s.t()).to(dtype) / temperature, dim=-1)
    lq = torch.log_softmax((hidden_t @ weight_t[:vocab].t()).to(dtype).detach() / temperature, dim=-1)
    if beta >= 1.0:
        d = (lp.exp() * (lp - lq)).sum(-1)
    elif beta <= 0.0:
        d = (lq.exp() * (lq - lp)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lq + math.log(beta), lp + math.log1p(-beta)]), dim=0)
        d = beta * (lq.exp() * (lq - lm)).sum(-1) + (1.0 - beta) * (lp.exp() * (lp - lm)).sum(-1)
    return d if mask is None else torch.where(mask, d, 0.0)
