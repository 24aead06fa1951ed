"""Policy-gradient losses of the PPO family, as pure functions returning (loss, metrics).

The definitions, their derivations and where we depart from the papers: docs/losses.md.
Policy losses (`policy_loss`, chosen by name from POLICY_LOSSES):
  ppo         clipped surrogate (Schulman et al. 2017), clip-higher (DAPO, Yu et al. 2025), dual
              clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games");
  gspo        sequence-level ratio s_i = exp(mean_t log(pi / pi_old)) and sequence-level clipping
              (GSPO, Zheng et al. 2025, arXiv 2507.18071);
  gspo_token  GSPO-token, the same paper: s_i,t = sg[s_i] * pi_t / sg[pi_t], clipped per token;
  cispo       the clipped IS weight as a stop-gradient coefficient on log pi, no clipping of the
              gradient path (CISPO, MiniMax-M1, arXiv 2506.13585).
Aggregations: token-mean (DAPO); seq-mean-token-mean (GRPO, Shao et al. 2024); seq-mean-token-
sum-norm (Dr.GRPO, Liu et al. 2025). KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL
divergence"). Importance correction against the rollout engine's log-probs (`is_correction`):
truncated (TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training") or masked (IcePop, as OpenRLHF, verl and TRL name it: the weight is the ratio inside
[is_mask_low, is_mask_high] and 0 outside), per token, per sequence, or per sequence by the
geometric mean (`tis_level`).

Layout: every token tensor is flat [N] (sequences concatenated, padded or packed); `mask` is 1 on
completion tokens and `seq_ids` names each token's sequence (a sequence's tokens contiguous).
Every aggregation is a weighted sum over tokens with weights fixed by mask, seq_ids and
`normalizer`, so with a global normalizer micro-batch losses SUM to the full-batch loss (a
sequence must not straddle micro-batches). GSPO's sequence loss L_i is carried by each of the
sequence's tokens and aggregated like a token loss (seq_mean_token_mean then gives the paper's
mean over sequences). Departures: normalizers are clamped to >= 1 so an all-masked batch gives
loss 0 rather than NaN; logp_old=None means on-policy (logp_old = logp.detach(), ratio == 1);
metrics are token means over this micro-batch; an IS weight multiplies the policy term only, not
the KL or entropy terms, and masked tokens stay in the normaliser.

The fused LM-head + log-prob + loss pass over these functions is `kernels.fused_loss`.
"""
from __future__ import annotations

import torch


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
        raise ValueError("this aggregation / policy loss / IS level needs seq_ids")
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


# --- sequences: per-token views of per-sequence sums -------------------------------------------
def _seq_info(mask, seq_ids):
    """{seq: dense sequence index [N], n_seq: S, seq_len: its sequence's unmasked count [N] (>= 1)},
    or Nones without seq_ids (then every sequence-level quantity raises)."""
    if seq_ids is None:
        return {"seq": None, "n_seq": 0, "seq_len": None}
    inv, counts = _seq_index(seq_ids, mask)
    return {"seq": inv, "n_seq": counts.numel(), "seq_len": counts[inv].clamp(min=1.0)}


def _seq_sum(x, tok):
    """Each token gets the sum of x over its sequence's tokens [n]. x is 0 at masked tokens; every
    sequence of the slice must be whole in it (the fused pass cuts chunks at sequence ends)."""
    if tok["seq"] is None:
        raise ValueError("this policy loss / IS level needs seq_ids")
    inv = tok["seq"]
    return torch.zeros(tok["n_seq"], dtype=x.dtype, device=x.device).index_add_(0, inv, x)[inv]


def _seq_mean(x, tok):
    return _seq_sum(x, tok) / tok["seq_len"]


# --- importance correction against the rollout engine ---------------------------------------
# log pi_old/pi_rollout per token [n] -> the log weight each token uses
IS_LEVELS = {"token": lambda lw, tok: lw,
             "sequence": _seq_sum,  # the product of the sequence's token ratios
             "geometric": _seq_mean}  # its geometric mean: length-normalised, like GSPO's ratio


def _truncate(w, hp):
    return w if hp["tis_cap"] is None else w.clamp(max=hp["tis_cap"])


def _mask(w, hp):
    return torch.where((w >= hp["is_mask_low"]) & (w <= hp["is_mask_high"]), w, 0.0)


IS_CORRECTIONS = {"tis": _truncate, "mask": _mask}  # ratio [n] -> detached weight [n]


def _is_weight(old, tok, hp):
    """Detached IS weight per token [n] from logp_old (known, or this chunk's logp.detach())."""
    log_w = IS_LEVELS[hp["tis_level"]](torch.where(tok["mask"], old - tok["logp_rollout"], 0.0), tok)
    return IS_CORRECTIONS[hp["is_correction"]](log_w.clamp(-20.0, 20.0).exp(), hp)


def importance_ratio(logp_old, logp_rollout, seq_ids=None, level="token"):
    """pi_old / pi_rollout per token [N] at `level` (before truncation or masking): the trainer's
    metrics (tis/ratio_*, is/masked_frac) and the Liger provider's weight use it."""
    mask = torch.ones_like(logp_old, dtype=torch.bool)
    tok = {"mask": mask, "logp_rollout": logp_rollout, **_seq_info(mask.float(), seq_ids)}
    return IS_LEVELS[level](logp_old - logp_rollout, tok).clamp(-20.0, 20.0).exp()


def importance_weights(logp_old, logp_rollout, seq_ids=None, *, level="token", correction="tis", tis_cap=None,
                       is_mask_low=0.5, is_mask_high=2.0):
    """The detached weight the loss multiplies each token's policy term by: [N]."""
    hp = dict(tis_cap=tis_cap, is_mask_low=is_mask_low, is_mask_high=is_mask_high)
    return IS_CORRECTIONS[correction](importance_ratio(logp_old, logp_rollout, seq_ids, level), hp)


# --- policy losses: per-token policy term [n] (before the IS weight and the aggregation) -------
def _clipped(ratio, adv, hp):
    """PPO's pessimistic clipped term; where the clipped branch wins, d/dratio is exactly 0."""
    surr = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - hp["eps_low"], 1.0 + hp["eps_high"]))
    if hp["dual_clip"] is not None:  # bound the loss of A < 0 tokens whose ratio exploded
        surr = torch.where(adv < 0, torch.minimum(surr, -adv * hp["dual_clip"]), surr)
    return surr


def _token_ratio(logp, old, tok):
    return torch.exp((logp - old).clamp(-20.0, 20.0))  # [n]


def _seq_ratio(logp, old, tok):
    """GSPO's s_i = exp(mean over the sequence's tokens of log(pi / pi_old)), on each token [n]."""
    return torch.exp(_seq_mean(torch.where(tok["mask"], logp - old, 0.0), tok).clamp(-20.0, 20.0))


def _ppo(logp, old, adv, tok, hp):
    """L_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)), r_t = pi / pi_old."""
    return _clipped(_token_ratio(logp, old, tok), adv, hp)


def _gspo(logp, old, adv, tok, hp):
    """GSPO (Zheng et al. 2025): L_i = max(-A s_i, -A clip(s_i, 1 - eps_low, 1 + eps_high)) on each
    of sequence i's tokens. d s_i / d logp_t = s_i / n_i: every token of a sequence gets the same
    gradient, and a clipped sequence none. Departure: a per-token advantage (reinforce_pp, gae)
    is used as it is, each token then carrying max(-A_t s_i, -A_t clip(s_i))."""
    return _clipped(_seq_ratio(logp, old, tok), adv, hp)


def _gspo_token(logp, old, adv, tok, hp):
    """GSPO-token (same paper): s_i,t = sg[s_i] * pi_t / sg[pi_t] has the value s_i and the
    gradient s_i * d logp_t; clipped per token like PPO. With one advantage per sequence its
    gradient equals GSPO's under seq_mean_token_mean; it differs with per-token advantages."""
    s = _seq_ratio(logp.detach(), old, tok) * torch.exp(logp - logp.detach())  # value s_i, grad s_i
    return _clipped(s, adv, hp)


def _cispo(logp, old, adv, tok, hp):
    """CISPO (MiniMax-M1, 2025): L_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * log pi_t.
    No token's gradient is zeroed: the clip bounds its weight, not its presence (the paper's
    motivation: PPO's clip drops the rare tokens that open reflective branches). The bounds are
    algo.cispo_clip_low/high (defaults 1 and 4: no lower bound, upper 5 as Liger's documentation suggests)."""
    w = _token_ratio(logp, old, tok).detach().clamp(1.0 - hp["cispo_clip_low"], 1.0 + hp["cispo_clip_high"])
    return -w * adv * logp


POLICY_LOSSES = {"ppo": _ppo, "gspo": _gspo, "gspo_token": _gspo_token, "cispo": _cispo}
SEQUENCE_LOSSES = ("gspo", "gspo_token")  # need a whole sequence's current log-probs at once
_METRIC_RATIO = {"ppo": _token_ratio, "gspo": _seq_ratio, "gspo_token": _seq_ratio, "cispo": _token_ratio}


def prepare_tokens(logp_old, advantages, mask, seq_ids, logp_rollout, logp_ref, *, agg, normalizer, dtype, hp):
    """Everything per token that does not depend on logp: detached, zero at masked tokens."""
    m = mask.bool()

    def clean(x):  # where, not *, so garbage (NaN, -inf) at masked tokens cannot leak
        return None if x is None else torch.where(m, x.detach().to(dtype), 0.0)

    mf = m.to(dtype)
    tok = {"mask": m, "adv": clean(advantages), "logp_old": clean(logp_old),
           "logp_ref": clean(logp_ref), "logp_rollout": clean(logp_rollout), "is_w": None,
           "agg_w": _agg_weights(agg, mf, seq_ids, normalizer), **_seq_info(mf, seq_ids)}
    if logp_rollout is not None and logp_old is not None:
        tok["is_w"] = _is_weight(tok["logp_old"], tok, hp)
    return tok


def token_losses(logp, entropy, tok, **hp):
    """Per-token contributions [n] with aggregation weights applied; their sum is the loss."""
    m = tok["mask"]
    logp = torch.where(m, logp, 0.0)  # [n]
    old = tok["logp_old"] if tok["logp_old"] is not None else logp.detach()
    total = POLICY_LOSSES[hp["policy_loss"]](logp, old, tok["adv"], tok, hp)  # [n]
    w = tok["is_w"]
    if w is None and tok["logp_rollout"] is not None:  # on-policy fused pass: old known only now
        w = _is_weight(old, tok, hp)
    if w is not None:
        total = total * w  # detached: the weight corrects the sampling distribution only
    if hp["kl_coef"] != 0.0:
        d = (tok["logp_ref"] - logp).clamp(-20.0, 20.0)
        total = total + hp["kl_coef"] * KL_ESTIMATORS[hp["kl_type"]](d)
    if hp["entropy_coef"] != 0.0:
        total = total - hp["entropy_coef"] * torch.where(m, entropy, 0.0)
    return total * tok["agg_w"]  # [n]


@torch.no_grad()
def loss_metrics(logp, entropy, tok, **hp):
    """Token means over this micro-batch's unmasked tokens, as detached 0-d tensors.

    ratio_*: the ratio the loss clips (per token; GSPO's sequence ratio on each of its tokens).
    clip_frac_low / _high: share of tokens whose gradient the lower (r < 1 - eps_low, A < 0) /
    upper (r > 1 + eps_high, A > 0) clip zeroes; clip_frac_dual likewise (r > c, A < 0). CISPO:
    share of tokens whose weight its lower / upper bound truncates (whatever the sign of A).
    """
    m = tok["mask"]
    n = m.sum().clamp(min=1)

    def mean(x):
        return torch.where(m, x.float(), 0.0).sum() / n

    logp = torch.where(m, logp, 0.0)
    old = tok["logp_old"] if tok["logp_old"] is not None else logp
    ratio = _METRIC_RATIO[hp["policy_loss"]](logp, old, tok)
    adv, any_tok = tok["adv"], m.any()
    if hp["policy_loss"] == "cispo":
        low, high = ratio < 1.0 - hp["cispo_clip_low"], ratio > 1.0 + hp["cispo_clip_high"]
    else:
        low, high = (ratio < 1.0 - hp["eps_low"]) & (adv < 0), (ratio > 1.0 + hp["eps_high"]) & (adv > 0)
    out = {
        "clip_frac_low": mean(low),
        "clip_frac_high": mean(high),
        "ratio_mean": mean(ratio),
        "ratio_min": torch.where(any_tok, torch.where(m, ratio, torch.inf).amin(), 0.0),
        "ratio_max": torch.where(any_tok, torch.where(m, ratio, -torch.inf).amax(), 0.0),
    }
    if hp["dual_clip"] is not None:
        out["clip_frac_dual"] = mean((ratio > hp["dual_clip"]) & (adv < 0))
    if tok["logp_ref"] is not None:
        out["kl_mean"] = mean(KL_ESTIMATORS[hp["kl_type"]]((tok["logp_ref"] - logp).clamp(-20.0, 20.0)))
    if entropy is not None:
        out["entropy_mean"] = mean(entropy)
    if tok["logp_rollout"] is not None:
        w = tok["is_w"] if tok["is_w"] is not None else _is_weight(old, tok, hp)
        out["tis_mean"] = mean(w)
    return out


def check_hparams(hp, agg, logp_ref, entropy_given):
    for name, table, key in (("agg", AGGREGATORS, agg), ("kl_type", KL_ESTIMATORS, hp["kl_type"]),
                             ("tis_level", IS_LEVELS, hp["tis_level"]),
                             ("policy_loss", POLICY_LOSSES, hp["policy_loss"]),
                             ("is_correction", IS_CORRECTIONS, hp["is_correction"])):
        if key not in table:
            raise ValueError(f"{name}={key!r}; choose from {sorted(table)}")
    if hp["kl_coef"] != 0.0 and logp_ref is None:
        raise ValueError("kl_coef != 0 needs logp_ref")
    if hp["entropy_coef"] != 0.0 and not entropy_given:
        raise ValueError("entropy_coef != 0 needs entropy")
    if hp["dual_clip"] is not None and (hp["dual_clip"] <= 1.0 or hp["policy_loss"] == "cispo"):
        raise ValueError("dual_clip must be > 1, and applies to the clipped losses (not cispo)")
    if not 0.0 <= hp["is_mask_low"] <= 1.0 <= hp["is_mask_high"]:
        raise ValueError("is_mask_low must be in [0, 1] and is_mask_high >= 1")
    if hp["cispo_clip_low"] < 0 or hp["cispo_clip_high"] < 0:
        raise ValueError("cispo_clip_low and cispo_clip_high must be >= 0")


def ppo_loss(logp, logp_old, advantages, mask, *, seq_ids=None, logp_rollout=None, logp_ref=None,
             entropy=None, policy_loss="ppo", eps_low=0.2, eps_high=0.2, dual_clip=None,
             cispo_clip_low=1.0, cispo_clip_high=4.0, is_correction="tis", tis_cap=None,
             tis_level="token", is_mask_low=0.5, is_mask_high=2.0, kl_coef=0.0, kl_type="k3",
             entropy_coef=0.0, agg="token_mean", normalizer=None):
    """agg(w * L) + kl_coef * agg(KL) - entropy_coef * agg(entropy), all token tensors [N].

    L: POLICY_LOSSES[policy_loss] (ppo: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), min'd
    with -A * dual_clip where A < 0); w (only with logp_rollout): the detached IS weight from
    exp(logp_old - logp_rollout) at tis_level, truncated at tis_cap (is_correction="tis") or
    0 outside [is_mask_low, is_mask_high] (is_correction="mask").
    Returns (loss, metrics: dict of detached 0-d tensors).
    """
    hp = dict(policy_loss=policy_loss, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
              cispo_clip_low=cispo_clip_low, cispo_clip_high=cispo_clip_high, is_correction=is_correction,
              tis_cap=tis_cap, tis_level=tis_level, is_mask_low=is_mask_low, is_mask_high=is_mask_high,
              kl_coef=kl_coef, kl_type=kl_type, entropy_coef=entropy_coef)
    check_hparams(hp, agg, logp_ref, entropy is not None)
    logp_old = logp.detach() if logp_old is None else logp_old
    tok = prepare_tokens(logp_old, advantages, mask, seq_ids, logp_rollout, logp_ref, agg=agg, normalizer=normalizer,
                   dtype=torch.promote_types(logp.dtype, torch.float32), hp=hp)
    loss = token_losses(logp, entropy, tok, **hp).sum()
    return loss, loss_metrics(logp.detach(), None if entropy is None else entropy.detach(), tok, **hp)
