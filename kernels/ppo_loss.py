"""Clipped policy-gradient loss of the PPO family, as pure functions returning (loss, metrics).

Math: /work/shared/notes/LOSS_MATH.md. Sources: PPO (Schulman et al. 2017); dual clip (Ye et al.
2020, "Mastering Complex Control in MOBA Games"); clip-higher and token-mean (DAPO, Yu et al.
2025); seq-mean-token-mean (GRPO, Shao et al. 2024); seq-mean-token-sum-norm (Dr.GRPO, Liu et
al. 2025); truncated importance sampling against the rollout engine (Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"); KL estimators k1/k2/k3
(Schulman 2020, "Approximating KL divergence").

Layout: every token tensor is flat [N] (sequences concatenated, padded or packed); `mask` is 1 on
completion tokens and `seq_ids` names each token's sequence. Every aggregation is a weighted sum
over tokens with weights fixed by mask, seq_ids and `normalizer`, so with a global normalizer
micro-batch losses SUM to the full-batch loss (a sequence must not straddle micro-batches).
Departures: normalizers are clamped to >= 1 so an all-masked batch gives loss 0 rather than NaN;
logp_old=None means on-policy (logp_old = logp.detach(), ratio == 1); metrics are token means
over this micro-batch.

`fused_logprob_ppo_loss` runs LM head + log-prob + loss per token chunk and produces dlogits in
the forward pass (6*N*V*d FLOPs instead of 8*N*V*d), using `kernels.logprob`'s chunk engine:
the loss is a sum of per-token terms with weights fixed before the pass, so each chunk's
dloss/dlogp is known as soon as its logp is. The torch backend keeps the chunk's softmax for the
dlogits; the Triton forward kernel writes the chunk's logits for the dlogits kernel to reuse.
"""
from __future__ import annotations

import inspect

import torch

from kernels.logprob import (BACKENDS, Workspace, accumulate_grads, logprob_entropy_reference,
                             masked_upstream, new_grads, resolve)


def _k1(d):
    return -d


def _k2(d):
    return 0.5 * d * d


def _k3(d):
    return (torch.expm1(d) - d).clamp(max=10.0)  # expm1: exact near d = 0, where k3 ~ d^2/2


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}  # each takes d = clamp(logp_ref - logp, +-20)


def _seq_index(seq_ids, mask):
    """Dense sequence index per token [N] and unmasked-token count per sequence [S]."""
    if seq_ids is None:
        raise ValueError("this aggregation / TIS level needs seq_ids")
    uniq, inv = torch.unique(seq_ids, return_inverse=True)  # [S], [N]
    m = mask if mask.is_floating_point() else mask.float()
    counts = torch.zeros(uniq.numel(), device=m.device, dtype=m.dtype)
    return inv, counts.index_add_(0, inv, m)  # [N], [S]


def _n_tokens(mask, seq_ids):
    return mask.sum()


def _n_seqs(mask, seq_ids):
    return (_seq_index(seq_ids, mask)[1] > 0).sum()


def _n_slots(mask, seq_ids):
    counts = _seq_index(seq_ids, mask)[1]
    return counts.numel() * (counts.max() if counts.numel() else 0)


def _per_token(mask, seq_ids, n):
    return mask / n


def _per_seq(mask, seq_ids, n):
    inv, counts = _seq_index(seq_ids, mask)
    return mask / counts[inv].clamp(min=1.0) / n


# name -> (default normaliser from this batch, per-token weights); agg(x) = sum(weights * x)
AGGREGATORS = {
    "token_mean": (_n_tokens, _per_token),  # DAPO: sum(m L) / #unmasked tokens
    "seq_mean_token_mean": (_n_seqs, _per_seq),  # GRPO: mean over sequences of their token mean
    "seq_mean_token_sum_norm": (_n_slots, _per_token),  # Dr.GRPO: sum(m L) / (batch * max_len)
}


def loss_normalizer(agg, mask, seq_ids=None):
    """What normalizer=None computes for this batch; call it on the FULL batch and pass the
    result to every micro-batch so their losses sum to the full-batch loss."""
    return AGGREGATORS[agg][0](mask.float(), seq_ids)


def _agg_weights(agg, mask, seq_ids, normalizer):
    """Per-token weights [N]; the normaliser is clamped to >= 1 (empty batch -> loss 0)."""
    default, weights = AGGREGATORS[agg]
    n = default(mask, seq_ids) if normalizer is None else normalizer
    return weights(mask, seq_ids, torch.as_tensor(n, dtype=mask.dtype, device=mask.device).clamp(min=1.0))


def _tis_token(log_w, mask, seq_ids):
    return log_w


def _tis_sequence(log_w, mask, seq_ids):
    inv, counts = _seq_index(seq_ids, mask)
    return torch.zeros_like(counts, dtype=log_w.dtype).index_add_(0, inv, log_w)[inv]  # masked sum


TIS_LEVELS = {"token": _tis_token, "sequence": _tis_sequence}  # log_w [N] -> log weight per token


def _tis_weight(log_w, tis_cap):
    w = log_w.clamp(-20.0, 20.0).exp()
    return w if tis_cap is None else w.clamp(max=tis_cap)


def _prepare(logp_old, advantages, mask, seq_ids, logp_rollout, logp_ref, *, tis_level, tis_cap,
             agg, normalizer, dtype):
    """Everything per token that does not depend on logp: detached, zero at masked tokens."""
    m = mask.bool()

    def clean(x):  # where, not *, so garbage (NaN, -inf) at masked tokens cannot leak
        return None if x is None else torch.where(m, x.detach().to(dtype), 0.0)

    tok = {"mask": m, "adv": clean(advantages), "logp_old": clean(logp_old),
           "logp_ref": clean(logp_ref), "logp_rollout": clean(logp_rollout), "tis_w": None,
           "agg_w": _agg_weights(agg, m.to(dtype), seq_ids, normalizer)}
    if logp_rollout is not None and logp_old is not None:
        log_w = TIS_LEVELS[tis_level](tok["logp_old"] - tok["logp_rollout"], m, seq_ids)
        tok["tis_w"] = _tis_weight(log_w, tis_cap)
    elif logp_rollout is not None and tis_level != "token":
        raise ValueError("sequence-level TIS needs logp_old before the pass; pass logp_old")
    return tok


def _token_losses(logp, entropy, tok, *, eps_low, eps_high, dual_clip, tis_cap, kl_coef, kl_type,
                  entropy_coef):
    """Per-token contributions [n] with aggregation weights applied; their sum is the loss."""
    m = tok["mask"]
    logp = torch.where(m, logp, 0.0)  # [n]
    old = tok["logp_old"] if tok["logp_old"] is not None else logp.detach()
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))  # [n]
    adv = tok["adv"]
    # max of the two branches: where the clipped one wins, d/dlogp is exactly 0
    surr = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    if dual_clip is not None:  # bound the loss of A < 0 tokens whose ratio exploded
        surr = torch.where(adv < 0, torch.minimum(surr, -adv * dual_clip), surr)
    w = tok["tis_w"]
    if w is None and tok["logp_rollout"] is not None:  # on-policy fused pass: old known only now
        w = _tis_weight(old - tok["logp_rollout"], tis_cap)
    if w is not None:
        surr = surr * w  # detached: the weight corrects the sampling distribution only
    total = surr
    if kl_coef != 0.0:
        d = (tok["logp_ref"] - logp).clamp(-20.0, 20.0)
        total = total + kl_coef * KL_ESTIMATORS[kl_type](d)
    if entropy_coef != 0.0:
        total = total - entropy_coef * torch.where(m, entropy, 0.0)
    return total * tok["agg_w"]  # [n]


@torch.no_grad()
def _metrics(logp, entropy, tok, *, eps_low, eps_high, dual_clip, tis_cap, kl_coef, kl_type,
             entropy_coef):
    """Token means over this micro-batch's unmasked tokens, as detached 0-d tensors.

    clip_frac_low / _high: share of tokens whose gradient the lower (r < 1 - eps_low, A < 0) /
    upper (r > 1 + eps_high, A > 0) clip zeroes; clip_frac_dual likewise (r > c, A < 0).
    """
    m = tok["mask"]
    n = m.sum().clamp(min=1)

    def mean(x):
        return torch.where(m, x.float(), 0.0).sum() / n

    logp = torch.where(m, logp, 0.0)
    old = tok["logp_old"] if tok["logp_old"] is not None else logp
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    adv, any_tok = tok["adv"], m.any()
    out = {
        "clip_frac_low": mean((ratio < 1.0 - eps_low) & (adv < 0)),
        "clip_frac_high": mean((ratio > 1.0 + eps_high) & (adv > 0)),
        "ratio_mean": mean(ratio),
        "ratio_min": torch.where(any_tok, torch.where(m, ratio, torch.inf).amin(), 0.0),
        "ratio_max": torch.where(any_tok, torch.where(m, ratio, -torch.inf).amax(), 0.0),
    }
    if dual_clip is not None:
        out["clip_frac_dual"] = mean((ratio > dual_clip) & (adv < 0))
    if tok["logp_ref"] is not None:
        out["kl_mean"] = mean(KL_ESTIMATORS[kl_type]((tok["logp_ref"] - logp).clamp(-20.0, 20.0)))
    if entropy is not None:
        out["entropy_mean"] = mean(entropy)
    if tok["logp_rollout"] is not None:
        w = tok["tis_w"] if tok["tis_w"] is not None else _tis_weight(old - tok["logp_rollout"], tis_cap)
        out["tis_mean"] = mean(w)
    return out


def _check(hp, agg, tis_level, logp_ref, entropy_given):
    for name, table, key in (("agg", AGGREGATORS, agg), ("kl_type", KL_ESTIMATORS, hp["kl_type"]),
                             ("tis_level", TIS_LEVELS, tis_level)):
        if key not in table:
            raise ValueError(f"{name}={key!r}; choose from {sorted(table)}")
    if hp["kl_coef"] != 0.0 and logp_ref is None:
        raise ValueError("kl_coef != 0 needs logp_ref")
    if hp["entropy_coef"] != 0.0 and not entropy_given:
        raise ValueError("entropy_coef != 0 needs entropy")
    if hp["dual_clip"] is not None and hp["dual_clip"] <= 1.0:
        raise ValueError("dual_clip must be > 1")


def ppo_loss(logp, logp_old, advantages, mask, *, seq_ids=None, logp_rollout=None, logp_ref=None,
             entropy=None, eps_low=0.2, eps_high=0.2, dual_clip=None, tis_cap=None,
             tis_level="token", kl_coef=0.0, kl_type="k3", entropy_coef=0.0, agg="token_mean",
             normalizer=None):
    """agg(w * L) + kl_coef * agg(KL) - entropy_coef * agg(entropy), all token tensors [N].

    L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), min'd with -A * dual_clip where A < 0;
    w = min(exp(logp_old - logp_rollout), tis_cap), detached, per token or per sequence.
    Returns (loss, metrics: dict of detached 0-d tensors).
    """
    hp = dict(eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, tis_cap=tis_cap,
              kl_coef=kl_coef, kl_type=kl_type, entropy_coef=entropy_coef)
    _check(hp, agg, tis_level, logp_ref, entropy is not None)
    logp_old = logp.detach() if logp_old is None else logp_old
    tok = _prepare(logp_old, advantages, mask, seq_ids, logp_rollout, logp_ref, tis_level=tis_level,
                   tis_cap=tis_cap, agg=agg, normalizer=normalizer,
                   dtype=torch.promote_types(logp.dtype, torch.float32))
    loss = _token_losses(logp, entropy, tok, **hp).sum()
    return loss, _metrics(logp.detach(), None if entropy is None else entropy.detach(), tok, **hp)


# ppo_loss's keyword arguments and defaults, minus `entropy` (the fused pass computes it)
_LOSS_DEFAULTS = {k: p.default for k, p in inspect.signature(ppo_loss).parameters.items()
                  if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "entropy"}


class _FusedLogprobLoss(torch.autograd.Function):
    """Forward computes the loss AND dH, dW, db chunk by chunk; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, provider, chunk, token_loss, grad_on):
        stats, grad_logits = BACKENDS[provider]
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        # needs_input_grad is True even under no_grad(); grad_on keeps evaluation at 2*N*V*d
        inv_t, need = 1.0 / temperature, tuple(n and grad_on for n in ctx.needs_input_grad[:3])
        dh, dw, db = new_grads(hidden, w, b, need)
        loss = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
        valid, logps, ents, ws = targets >= 0, [], [], Workspace()
        for i in range(0, hidden.shape[0], chunk):
            sl = slice(i, i + chunk)
            logp, ent, aux, state = stats(hidden[sl], w, b, targets[sl], inv_t, any(need), ws)
            with torch.enable_grad():  # dloss/dlogp, dloss/dH per token: O(chunk) autograd
                lp, en = logp.detach().requires_grad_(), ent.detach().requires_grad_()
                part = token_loss(lp, en, sl).sum()
                g_lp, g_ent = torch.autograd.grad(part, (lp, en), allow_unused=True)
            loss += part.detach()
            logps.append(logp)
            ents.append(ent)
            if any(need):
                g_lp = masked_upstream(torch.zeros_like(logp) if g_lp is None else g_lp, valid[sl])
                g = grad_logits(hidden[sl], w, b, targets[sl], inv_t, aux, ent, g_lp,
                                masked_upstream(g_ent, valid[sl]), state, ws)  # [c, V]
                accumulate_grads(g, hidden[sl], w, None if dh is None else dh[sl], dw, db)
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        logp, ent = torch.cat(logps), torch.cat(ents)
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        grads = [None if g is None else (g * g_loss).to(dt)
                 for g, dt in zip(ctx.saved_tensors, ctx.dtypes)]
        return (*grads, None, None, None, None, None, None)


def fused_logprob_ppo_loss(hidden, weight, targets, logp_old, advantages, mask, temperature=1.0,
                           bias=None, *, provider="auto", chunk_size=None, **loss_kwargs):
    """`ppo_loss(*logprob_entropy(...))` in one pass per token chunk.

    Same arguments as `logprob_entropy` plus `ppo_loss`'s (`entropy` is computed here).
    Returns (loss, metrics, logp, entropy); logp and entropy are detached (for logging only).
    Departure: with logp_old=None (on-policy), sequence-level TIS is refused (it would need
    every logp before the first chunk's gradient).
    """
    if provider == "naive":
        logp, ent = logprob_entropy_reference(hidden, weight, targets, temperature, bias)
        loss, metrics = ppo_loss(logp, logp_old, advantages, mask, entropy=ent, **loss_kwargs)
        return loss, metrics, logp.detach(), ent.detach()
    unknown = set(loss_kwargs) - set(_LOSS_DEFAULTS)
    if unknown:
        raise TypeError(f"unexpected loss arguments {sorted(unknown)}")
    kw = {**_LOSS_DEFAULTS, **loss_kwargs}
    data = {k: kw.pop(k) for k in ("seq_ids", "logp_rollout", "logp_ref", "tis_level", "agg",
                                   "normalizer")}
    _check(kw, data["agg"], data["tis_level"], data["logp_ref"], True)
    provider, chunk = resolve(provider, hidden, chunk_size, weight.shape[0])
    tok = _prepare(logp_old, advantages, mask, tis_cap=kw["tis_cap"], **data,
                   dtype=torch.promote_types(hidden.dtype, torch.float32))

    def token_loss(logp, ent, sl):
        part = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in tok.items()}
        return _token_losses(logp, ent, part, **kw)

    loss, logp, ent = _FusedLogprobLoss.apply(hidden, weight, bias, targets, float(temperature),
                                              provider, chunk, token_loss, torch.is_grad_enabled())
    return loss, _metrics(logp, ent, tok, **kw), logp, ent
