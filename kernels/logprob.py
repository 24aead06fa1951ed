"""Per-token log-prob and entropy of the sampled token, fused with the LM head.

    z = (hidden @ weight.T + bias) / T;  logp = z[y] - logsumexp(z);  H = logsumexp(z) - sum softmax(z) z

The full [N, V] logits are never held at once (at N=16k, V=128k they are 8 GiB in fp32).
Providers:
  "triton": a Triton forward kernel tiles tokens x vocab with an online log-sum-exp (and an
            online entropy), keeping O(N) state; the backward recomputes logit tiles per token
            chunk in a second kernel and hands dlogits to two GEMMs (dH, dW).
  "torch":  chunks tokens in plain PyTorch; the backward recomputes each chunk's logits and
            ACCUMULATES dW over chunks. The CPU production path.
  "naive":  `logprob_entropy_reference`: full logits and plain autograd; the ground truth.
Departures: targets < 0 (e.g. -100) mark ignored positions: logp and entropy are 0 there and
no gradient flows from them. Outputs are fp32 (fp64 for fp64 inputs, so gradcheck works).
The chunk engine (`chunked_forward`, `chunked_backward`, `accumulate_grads`) is shared with
`kernels.fused_loss.fused_logprob_ppo_loss`, which produces dlogits already in the forward pass.
Used as `logp, ent = logprob_entropy(h, lm_head.weight, targets, temperature)`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch provider works without triton
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Interpreter blocks are small so tests stay fast; GPU blocks are untuned guesses.
BLOCK_N, BLOCK_V, BLOCK_D = (16, 32, 16) if INTERPRET else (64, 128, 64)
# Elements of one [chunk, V] fp32 buffer (the torch path keeps 3). CPU: 2^24 = chunk 512 at
# V=32k, faster than the naive full-logits pass at a fraction of its peak memory; much smaller
# chunks make the GEMMs too thin to pay. GPU: larger chunks to feed the GEMMs; untuned.
# Timings and peak memory: docs/speed.md, "the log-prob kernels".
CPU_CHUNK_ELEMS, GPU_CHUNK_ELEMS = 2**24, 2**27


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# Devices whose LM head runs in autocast's dtype under train.precision=amp. A GPU's: the head is the
# step's largest GEMM, and in float32 it roughly doubles the train, old-log-prob and reference passes.
# Not a CPU's: there amp is the default, chosen because it learns as float32 does, and its logits
# rounded to bfloat16 cost held-out accuracy (SmolLM2-135M, 15 steps, seed 0: 83.5% with a float32
# head, 67.0% with a bfloat16 one, float32 weights 75.8%; tests/test_pretrained.py).
HEAD_IN_AUTOCAST = {"cuda": True}


def autocast_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` in autocast's dtype where autocast is on for its device and HEAD_IN_AUTOCAST names it,
    as F.linear would take it there (a floating-point tensor other than float64). The chunk engine's
    GEMMs write into buffers (`torch.mm(..., out=)`, `addmm_`), which autocast passes by: under
    train.precision=amp the hidden states after the final norm and the head's weight are float32, so
    the head would run in float32. From a low-precision hidden the kernels take their bf16 path (the
    weight cast to it, low-precision GEMMs, float32 log-softmax, logits and dW accumulators), which
    matches `logprob_entropy_reference` under the same autocast."""
    device = hidden.device.type
    if (
        not HEAD_IN_AUTOCAST.get(device, False)
        or not torch.is_autocast_enabled(device)
        or not hidden.is_floating_point()
        or hidden.dtype == torch.float64
    ):
        return hidden
    return hidden.to(torch.get_autocast_dtype(device))  # differentiable: dH returns in hidden's dtype


def default_chunk_size(n_tokens: int, vocab: int, is_cuda: bool) -> int:
    elems = GPU_CHUNK_ELEMS if is_cuda else CPU_CHUNK_ELEMS
    return max(1, min(n_tokens, elems // vocab))


class Workspace:
    """[rows, V] buffers reused across the chunks of one call. On CPU a fresh 16-64 MiB tensor
    costs more in page faults than the elementwise pass that fills it."""

    def __init__(self):
        self.bufs = {}

    def get(self, name, rows, cols, dtype, device):
        buf = self.bufs.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self.bufs[name] = torch.empty(rows, cols, dtype=dtype, device=device)
        return buf[:rows]  # leading rows of a contiguous buffer: contiguous

    def temp(self, name, rows, cols, dtype, device):
        """A short-lived buffer: `get`'s reused one on CPU; elsewhere a fresh tensor, which the CUDA
        caching allocator serves from freed blocks without holding every such buffer at once
        (kept across chunks, the bf16 copies of the logits, of g and of dW all stay in the peak)."""
        if torch.device(device).type == "cpu":
            return self.get(name, rows, cols, dtype, device)
        return torch.empty(rows, cols, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- torch backend
def _torch_log_softmax(h, w, b, inv_t: float, ws: Workspace):
    """One chunk's log-softmax and softmax, each [c, V] fp32 (fp64 for fp64 inputs)."""
    c, V = h.shape[0], w.shape[0]
    z = ws.get("lp", c, V, _compute_dtype(w.dtype), h.device)  # [c, V]
    if z.dtype == w.dtype:
        torch.mm(h, w.t(), out=z) if b is None else torch.addmm(b, h, w.t(), out=z)
    else:  # bf16/fp16 GEMM into a reused buffer, fp32 softmax
        zl = ws.temp("z_low", c, V, w.dtype, h.device)
        torch.mm(h, w.t(), out=zl) if b is None else torch.addmm(b, h, w.t(), out=zl)
        z.copy_(zl)
    if inv_t != 1.0:
        z.mul_(inv_t)
    # in place on CPU (ATen's row kernel reads a row before writing it); CUDA allocations are cheap
    lp = torch.log_softmax(z, 1, out=z if z.device.type == "cpu" else None)  # [c, V]
    return lp, torch.exp(lp, out=ws.get("p", c, V, lp.dtype, h.device))  # softmax, one pass


def _torch_stats(h, w, b, y, inv_t: float, keep: bool, ws: Workspace):
    """One chunk -> (logp, entropy, aux, state); aux is None (the backward recomputes the
    log-softmax, cheaper than saving lse and subtracting it), state = (log_softmax, softmax)."""
    lp, p = _torch_log_softmax(h, w, b, inv_t, ws)
    scratch = ws.get("scratch", *lp.shape, lp.dtype, h.device)
    ent = -torch.mul(p, lp, out=scratch).sum(1)  # [c]; mul+sum: faster than bmm's row dot on CPU
    logp = lp.gather(1, y.clamp(min=0).long().unsqueeze(1)).squeeze(1)  # [c]
    valid = y >= 0
    return (torch.where(valid, logp, 0.0), torch.where(valid, ent, 0.0), None, (lp, p) if keep else None)


def _torch_grad_logits(h, w, b, y, inv_t, aux, ent, g_logp, g_ent, state, ws: Workspace):
    """dloss/dlogits for one chunk, [c, V], in place on the state's buffers.

    dlogp/dz = onehot(y) - p;  dH/dz = -p * (log p + H);  dz/dlogits = 1/T.
    """
    lp, p = state if state is not None else _torch_log_softmax(h, w, b, inv_t, ws)
    if g_ent is None:
        g = p.mul_((-inv_t * g_logp).unsqueeze(1))
    else:
        g = lp.add_(ent.unsqueeze(1)).mul_((-inv_t * g_ent).unsqueeze(1))
        g = g.sub_((inv_t * g_logp).unsqueeze(1)).mul_(p)
    y_safe = y.clamp(min=0).long().unsqueeze(1)  # ignored rows have g_logp == 0
    return g.scatter_add_(1, y_safe, (g_logp * inv_t).unsqueeze(1).to(g.dtype))


# ---------------------------------------------------------------------------- triton backend
if triton is not None:
    _INTERPRET = tl.constexpr(INTERPRET)

    @triton.jit
    def _logits_tile(
        H,
        W,
        rn,
        rv,
        nmask,
        vmask,
        D,
        s_hn,
        s_hd,
        s_wv,
        s_wd,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            dmask = rd < D
            h = tl.load(
                H + rn[:, None] * s_hn + rd[None, :] * s_hd, mask=nmask[:, None] & dmask[None, :], other=0.0
            )  # [BN, BD]
            w = tl.load(
                W + rv[:, None] * s_wv + rd[None, :] * s_wd, mask=vmask[:, None] & dmask[None, :], other=0.0
            )  # [BV, BD]
            if _INTERPRET:  # the CPU interpreter's tl.dot mangles bf16 operands (triton 3.9)
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        return acc  # [BN, BV] fp32

    @triton.jit
    def _fwd_kernel(
        H,
        W,
        B,
        Y,
        LOGP,
        ENT,
        LSE,
        Z,
        N,
        V,
        D,
        s_hn,
        s_hd,
        s_wv,
        s_wd,
        s_zn,
        inv_t,
        HAS_BIAS: tl.constexpr,
        STORE_Z: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per BLOCK_N tokens, streaming vocab tiles (online softmax, FlashAttention-style).

        Besides max m and sum s it keeps a = sum e^(z-m) (z-m), so H = log s - a/s at the end.
        """
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        y = tl.load(Y + rn, mask=nmask, other=-1)
        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        a = tl.zeros((BLOCK_N,), tl.float32)
        zy = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            rv = v0 + tl.arange(0, BLOCK_V)
            vmask = rv < V
            z = _logits_tile(
                H, W, rn, rv, nmask, vmask, D, s_hn, s_hd, s_wv, s_wd, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
            )
            if HAS_BIAS:
                z += tl.load(B + rv, mask=vmask, other=0.0).to(tl.float32)[None, :]
            z = tl.where(vmask[None, :], z * inv_t, float("-inf"))  # [BN, BV]
            if STORE_Z:  # the fused loss reuses these logits instead of recomputing them
                tl.store(Z + rn[:, None] * s_zn + rv[None, :], z, mask=nmask[:, None] & vmask[None, :])
            zy += tl.sum(tl.where(rv[None, :] == y[:, None], z, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            alpha = tl.exp(m - m_new)
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)  # avoid 0 * -inf on the first tile
            zs = tl.where(vmask[None, :], z - m_new[:, None], 0.0)
            e = tl.exp(zs) * vmask[None, :]
            a = alpha * (a + s * shift) + tl.sum(e * zs, axis=1)
            s = alpha * s + tl.sum(e, axis=1)
            m = m_new
        log_s = tl.log(s)
        valid = y >= 0
        tl.store(LOGP + rn, tl.where(valid, zy - m - log_s, 0.0), mask=nmask)
        tl.store(ENT + rn, tl.where(valid, log_s - a / s, 0.0), mask=nmask)
        tl.store(LSE + rn, m + log_s, mask=nmask)

    @triton.jit
    def _grad_kernel(
        H,
        W,
        B,
        Y,
        LSE,
        ENT,
        GLP,
        GENT,
        Z,
        G,
        N,
        V,
        D,
        s_hn,
        s_hd,
        s_wv,
        s_wd,
        s_zn,
        s_gn,
        inv_t,
        HAS_BIAS: tl.constexpr,
        RECOMPUTE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """dlogits for one [BLOCK_N, BLOCK_V] tile: (g_lp (onehot - p) - g_H p (log p + H)) / T."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        nmask, vmask = rn < N, rv < V
        tile_mask = nmask[:, None] & vmask[None, :]
        if RECOMPUTE:
            z = _logits_tile(
                H, W, rn, rv, nmask, vmask, D, s_hn, s_hd, s_wv, s_wd, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION
            )
            if HAS_BIAS:
                z += tl.load(B + rv, mask=vmask, other=0.0).to(tl.float32)[None, :]
            z = z * inv_t
        else:
            z = tl.load(Z + rn[:, None] * s_zn + rv[None, :], mask=tile_mask, other=0.0)
        y = tl.load(Y + rn, mask=nmask, other=-1)
        lse = tl.load(LSE + rn, mask=nmask, other=0.0)
        ent = tl.load(ENT + rn, mask=nmask, other=0.0)
        g_lp = tl.load(GLP + rn, mask=nmask, other=0.0)
        g_h = tl.load(GENT + rn, mask=nmask, other=0.0)
        lp = tl.where(tile_mask, z - lse[:, None], 0.0)  # [BN, BV] log-probs; 0 off the edge, no overflow
        g = -tl.exp(lp) * (g_lp[:, None] + g_h[:, None] * (lp + ent[:, None]))
        g += tl.where(rv[None, :] == y[:, None], g_lp[:, None], 0.0)
        tl.store(G + rn[:, None] * s_gn + rv[None, :], (g * inv_t).to(G.dtype.element_ty), mask=tile_mask)


def _check_triton(h):
    if triton is None:
        raise RuntimeError("provider='triton' needs the triton package")
    if not (h.is_cuda or INTERPRET):
        raise RuntimeError("provider='triton' on CPU needs TRITON_INTERPRET=1 set before importing triton")


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else None  # no TF32: logits reach 1e4 in tests


def _triton_stats(h, w, b, y, inv_t: float, keep: bool, ws: Workspace):
    _check_triton(h)
    c, (V, d) = h.shape[0], w.shape
    logp, ent, lse = (torch.empty(c, device=h.device, dtype=torch.float32) for _ in range(3))
    z = ws.get("z", c, V, torch.float32, h.device) if keep else lse  # [c, V] logits, or a dummy
    _fwd_kernel[(triton.cdiv(c, BLOCK_N),)](
        h,
        w,
        b if b is not None else w,
        y,
        logp,
        ent,
        lse,
        z,
        c,
        V,
        d,
        h.stride(0),
        h.stride(1),
        w.stride(0),
        w.stride(1),
        z.stride(0),
        inv_t,
        HAS_BIAS=b is not None,
        STORE_Z=keep,
        BLOCK_N=BLOCK_N,
        BLOCK_V=BLOCK_V,
        BLOCK_D=BLOCK_D,
        PRECISION=_precision(h.dtype),
    )
    return logp, ent, lse, (z if keep else None)


def _triton_grad_logits(h, w, b, y, inv_t, lse, ent, g_logp, g_ent, state, ws: Workspace):
    c, (V, d) = h.shape[0], w.shape
    # in place over the stored fp32 logits when the GEMMs run in fp32, else a matmul-dtype buffer
    g = state if state is not None and w.dtype == torch.float32 else ws.get("g", c, V, w.dtype, h.device)
    z = state if state is not None else g
    g_ent = torch.zeros_like(g_logp) if g_ent is None else g_ent
    _grad_kernel[(triton.cdiv(c, BLOCK_N), triton.cdiv(V, BLOCK_V))](
        h,
        w,
        b if b is not None else w,
        y,
        lse,
        ent,
        g_logp,
        g_ent,
        z,
        g,
        c,
        V,
        d,
        h.stride(0),
        h.stride(1),
        w.stride(0),
        w.stride(1),
        z.stride(0),
        g.stride(0),
        inv_t,
        HAS_BIAS=b is not None,
        RECOMPUTE=state is None,
        BLOCK_N=BLOCK_N,
        BLOCK_V=BLOCK_V,
        BLOCK_D=BLOCK_D,
        PRECISION=_precision(h.dtype),
    )
    return g


BACKENDS = {"torch": (_torch_stats, _torch_grad_logits), "triton": (_triton_stats, _triton_grad_logits)}


# ------------------------------------------------------------------------------ chunk engine
def resolve(provider: str, hidden: torch.Tensor, chunk_size: int | None, vocab: int):
    """Pick (provider name, chunk size); "auto" means triton on CUDA, torch elsewhere."""
    if provider == "auto":
        provider = "triton" if hidden.is_cuda and triton is not None else "torch"
    chunk = chunk_size or default_chunk_size(hidden.shape[0], vocab, hidden.is_cuda)
    return provider, max(1, int(chunk))


def chunked_forward(stats, h, w, b, y, inv_t, chunk):
    """Run `stats` over token chunks; returns logp, entropy, aux (each [N]; aux may be None)."""
    ws = Workspace()
    outs = [stats(h[i : i + chunk], w, b, y[i : i + chunk], inv_t, False, ws)[:3] for i in range(0, h.shape[0], chunk)]
    return tuple(None if t[0] is None else torch.cat(t) for t in zip(*outs))


def new_grads(h, w, b, need):
    """Zeroed fp32 dW/db accumulators (fp64 for fp64 inputs) and a dH buffer, or None."""
    acc = _compute_dtype(w.dtype)
    return (
        torch.empty(h.shape, device=h.device, dtype=h.dtype) if need[0] else None,
        torch.zeros(w.shape, device=w.device, dtype=acc) if need[1] else None,
        torch.zeros(w.shape[0], device=w.device, dtype=acc) if need[2] and b is not None else None,
    )


def accumulate_grads(g, h_c, w, dh_c, dw, db, ws: Workspace | None = None):
    """dH[chunk] = g @ W (written), dW += g^T @ h and db += sum g (accumulated over chunks).
    bf16/fp16 weights: the low-precision copies of g and of the chunk's dW go to `ws`'s buffers,
    reused across chunks (fresh [c, V] and [V, d] tensors cost page faults on CPU)."""

    def low(name, rows, cols):
        return (
            torch.empty(rows, cols, dtype=w.dtype, device=w.device)
            if ws is None
            else ws.temp(name, rows, cols, w.dtype, w.device)
        )

    g_mm = g if g.dtype == w.dtype else low("g_low", *g.shape).copy_(g)  # [c, V] in the matmul dtype
    if dh_c is not None:
        torch.mm(g_mm, w, out=dh_c)  # [c, d]
    if dw is not None:
        if dw.dtype == g_mm.dtype:
            dw.addmm_(g_mm.t(), h_c)  # [V, d]; addmm_ adds, it never overwrites earlier chunks
        else:
            dw.add_(torch.mm(g_mm.t(), h_c, out=low("dw_low", *dw.shape)))
    if db is not None:
        db.add_(g.sum(0))


def chunked_backward(grad_logits, h, w, b, y, inv_t, aux, ent, g_logp, g_ent, chunk, need):
    dh, dw, db = new_grads(h, w, b, need)
    ws = Workspace()
    for i in range(0, h.shape[0], chunk):
        sl = slice(i, i + chunk)
        g = grad_logits(
            h[sl],
            w,
            b,
            y[sl],
            inv_t,
            None if aux is None else aux[sl],
            ent[sl],
            g_logp[sl],
            None if g_ent is None else g_ent[sl],
            None,
            ws,
        )
        accumulate_grads(g, h[sl], w, None if dh is None else dh[sl], dw, db, ws)
    return dh, dw, db


def masked_upstream(g, valid):
    """Upstream grads zeroed at ignored targets (where, not *, so NaN/inf cannot leak)."""
    return None if g is None else torch.where(valid, g, 0.0)


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, provider, chunk):
        stats, _ = BACKENDS[provider]
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        # the kernel streams vocab tiles, so it needs no token chunking in the forward
        fwd_chunk = hidden.shape[0] if provider == "triton" else chunk
        logp, ent, aux = chunked_forward(stats, hidden, w, b, targets, 1.0 / temperature, max(fwd_chunk, 1))
        ctx.save_for_backward(hidden, w, b, targets, aux, ent)
        ctx.meta = (provider, chunk, 1.0 / temperature, weight.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)  # None upstream: skip that term (e.g. entropy unused)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, w, b, targets, aux, ent = ctx.saved_tensors
        provider, chunk, inv_t, w_dtype, b_dtype = ctx.meta
        if g_logp is None and g_ent is None:
            return (None,) * 7
        valid = targets >= 0
        g_logp = masked_upstream(g_logp, valid) if g_logp is not None else torch.zeros_like(ent)
        need = ctx.needs_input_grad[:3]
        dh, dw, db = chunked_backward(
            BACKENDS[provider][1],
            hidden,
            w,
            b,
            targets,
            inv_t,
            aux,
            ent,
            g_logp,
            masked_upstream(g_ent, valid),
            chunk,
            need,
        )
        return (
            dh,
            None if dw is None else dw.to(w_dtype),
            None if db is None else db.to(b_dtype),
            None,
            None,
            None,
            None,
        )


def logprob_entropy(hidden, weight, targets, temperature=1.0, bias=None, *, provider="auto", chunk_size=None):
    """Log-prob of `targets` and entropy under softmax((hidden @ weight.T + bias) / temperature).

    hidden [N, d] (any float dtype, any strides), weight [V, d], bias [V] or None, targets [N]
    int32/int64 (< 0: ignored, logp = entropy = 0, no gradient). Returns (logp [N], entropy [N])
    in fp32, differentiable w.r.t. hidden, weight and bias through both outputs. Under autocast the
    GEMMs run in autocast's dtype, as the reference's F.linear does (`autocast_hidden`).
    """
    if provider == "naive":
        return logprob_entropy_reference(hidden, weight, targets, temperature, bias)
    hidden = autocast_hidden(hidden)  # the weight follows it inside; dW stays in the weight's dtype
    provider, chunk = resolve(provider, hidden, chunk_size, weight.shape[0])
    return _LogprobEntropy.apply(hidden, weight, bias, targets, float(temperature), provider, chunk)


def logprob_entropy_reference(
    hidden, weight, targets, temperature=1.0, bias=None, *, provider="naive", chunk_size=None
):
    """Ground truth: full [N, V] logits and plain autograd (provider/chunk_size are ignored)."""
    logits = F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))
    logits = logits.to(_compute_dtype(hidden.dtype)) / temperature  # [N, V]
    logp_all = logits.log_softmax(-1)  # [N, V]
    valid = targets >= 0
    logp = logp_all.gather(1, targets.clamp(min=0).long().unsqueeze(1)).squeeze(1)  # [N]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)
