"""The LM head, log-prob and PPO-family loss fused, one pass per token chunk.

`fused_logprob_ppo_loss` runs LM head + log-prob + loss per token chunk and produces dlogits in
the forward pass (6*N*V*d FLOPs instead of 8*N*V*d), using `kernels.logprob`'s chunk engine:
the loss is a sum of per-token terms with weights fixed before the pass, so each chunk's
dloss/dlogp is known as soon as its logp is. A sequence-level quantity of the current policy
(GSPO's ratio; a sequence IS weight on-policy) needs all of a sequence's log-probs, so then the
chunks are cut at sequence boundaries (a sequence longer than the chunk gets a chunk of its own).
The torch backend keeps the chunk's softmax for the dlogits; the Triton forward kernel writes the
chunk's logits for the dlogits kernel to reuse.

The loss itself (its terms, aggregations and checks) is `kernels.ppo_loss`'s, shared unchanged.
"""

from __future__ import annotations

import inspect

import torch

from hybridrl.algorithms.registry import param_names, policy_loss
from hybridrl.kernels.logprob import (
    BACKENDS,
    Workspace,
    accumulate_grads,
    autocast_hidden,
    logprob_entropy_reference,
    masked_upstream,
    new_grads,
    resolve,
)
from hybridrl.kernels.ppo_loss import check_hparams, loss_metrics, ppo_loss, prepare_tokens, token_losses

# ppo_loss's keyword arguments and defaults, minus `entropy` (the fused pass computes it); each policy
# loss's own hyperparameters come besides them (registry.param_names)
_LOSS_DEFAULTS = {
    k: p.default
    for k, p in inspect.signature(ppo_loss).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "entropy"
}
_DATA = ("seq_ids", "logp_rollout", "logp_ref", "agg", "normalizer")  # the rest are hyperparameters


def chunks(n, chunk, seq_ids=None):
    """Token slices of at most `chunk` tokens; with seq_ids, cut only at sequence ends (a sequence
    longer than `chunk` gets one slice of its own). A sequence's tokens must be contiguous."""
    if seq_ids is None:
        return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]
    new = torch.ones(n, dtype=torch.bool, device=seq_ids.device)
    new[1:] = seq_ids[1:] != seq_ids[:-1]
    ends = new.nonzero().flatten().tolist()[1:] + [n]  # where each sequence ends (exclusive)
    if n and len(ends) != torch.unique(seq_ids).numel():
        raise ValueError("seq_ids: a sequence's tokens must be contiguous")
    out, lo, last = [], 0, 0
    for end in ends:
        if end - lo > chunk and last > lo:
            out.append(slice(lo, last))
            lo = last
        last = end
    return out + ([slice(lo, n)] if lo < n else [])


class _FusedLogprobLoss(torch.autograd.Function):
    """Forward computes the loss AND dH, dW, db chunk by chunk; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, provider, slices, token_loss, grad_on):
        stats, grad_logits = BACKENDS[provider]
        w = weight.to(hidden.dtype)
        b = None if bias is None else bias.to(hidden.dtype)
        # needs_input_grad is True even under no_grad(); grad_on keeps evaluation at 2*N*V*d
        inv_t, need = 1.0 / temperature, tuple(n and grad_on for n in ctx.needs_input_grad[:3])
        dh, dw, db = new_grads(hidden, w, b, need)
        loss = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
        valid, logps, ents, ws = targets >= 0, [], [], Workspace()
        for sl in slices:
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
                g = grad_logits(
                    hidden[sl], w, b, targets[sl], inv_t, aux, ent, g_lp, masked_upstream(g_ent, valid[sl]), state, ws
                )  # [c, V]
                accumulate_grads(g, hidden[sl], w, None if dh is None else dh[sl], dw, db, ws)
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        logp, ent = torch.cat(logps), torch.cat(ents)
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        # to the parameter's dtype first, then scaled: one [V, d] tensor, not two (g_loss is the
        # engine's loss scale, 1 on one rank: on CPU, where reading it costs no device sync, a scale
        # of 1 skips the multiply, a full pass over the [V, d] head's gradient)
        one = g_loss.device.type == "cpu" and float(g_loss) == 1.0
        grads = []
        for g, dt in zip(ctx.saved_tensors, ctx.dtypes):
            if g is not None and one:
                g = g.to(dt)
            elif g is not None:
                g = g.to(dt).mul_(g_loss.to(dt)) if g.dtype != dt else g * g_loss
            grads.append(g)
        return (*grads, None, None, None, None, None, None)


def fused_logprob_ppo_loss(
    hidden,
    weight,
    targets,
    logp_old,
    advantages,
    mask,
    temperature=1.0,
    bias=None,
    *,
    provider="auto",
    chunk_size=None,
    **loss_kwargs,
):
    """`ppo_loss(*logprob_entropy(...))` in one pass per token chunk.

    Same arguments as `logprob_entropy` plus `ppo_loss`'s (`entropy` is computed here).
    Returns (loss, metrics, logp, entropy); logp and entropy are detached (for logging only).
    """
    if provider == "naive":
        logp, ent = logprob_entropy_reference(hidden, weight, targets, temperature, bias)
        loss, metrics = ppo_loss(logp, logp_old, advantages, mask, entropy=ent, **loss_kwargs)
        return loss, metrics, logp.detach(), ent.detach()
    unknown = set(loss_kwargs) - set(_LOSS_DEFAULTS) - param_names()
    if unknown:
        raise TypeError(f"unexpected loss arguments {sorted(unknown)}")
    hp = {**_LOSS_DEFAULTS, **loss_kwargs}
    data = {k: hp.pop(k) for k in _DATA}
    check_hparams(hp, data["agg"], data["logp_ref"], True)
    hidden = autocast_hidden(hidden)  # under autocast the head's GEMMs in its dtype, as logprob_entropy's
    provider, chunk = resolve(provider, hidden, chunk_size, weight.shape[0])
    tok = prepare_tokens(
        logp_old, advantages, mask, **data, dtype=torch.promote_types(hidden.dtype, torch.float32), hp=hp
    )
    # the current policy's sequence-level quantities need whole sequences per chunk
    whole = policy_loss(hp["policy_loss"]).sequence or (
        tok["is_w"] is None and data["logp_rollout"] is not None and hp["tis_level"] != "token"
    )
    slices = chunks(hidden.shape[0], chunk, data["seq_ids"] if whole else None)

    def token_loss(logp, ent, sl):
        part = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in tok.items()}
        return token_losses(logp, ent, part, **hp)

    loss, logp, ent = _FusedLogprobLoss.apply(
        hidden, weight, bias, targets, float(temperature), provider, slices, token_loss, torch.is_grad_enabled()
    )
    return loss, loss_metrics(logp, ent, tok, **hp), logp, ent
