"""Policy-gradient losses of the PPO family, as pure functions returning (loss, metrics).

The definitions, their derivations and where we depart from the papers: docs/losses.md.
Policy losses (`policy_loss`): each declared once, in its own module under
hybridrl/algorithms/losses/ (ppo, gspo, gspo_token, cispo, gmpo), with its hyperparameters as a
dataclass there (passed here by keyword) and its properties (hybridrl/algorithms/registry.py).
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

from hybridrl.algorithms.kl import KL_ESTIMATORS  # each takes d = clamp(logp_ref - logp, +-20)
from hybridrl.algorithms.losses.common import seq_mean, seq_sum
from hybridrl.algorithms.registry import POLICY_LOSSES, loss_params, param_names, policy_loss


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


def agg_weights(agg, mask, seq_ids=None, normalizer=None):
    """Per-token weights [N] of `agg` (a float mask): sum(weights * x) aggregates any per-token term
    as the policy loss is (the distillation divergence, algo.distill_loss full)."""
    return _agg_weights(agg, mask.float(), seq_ids, normalizer)


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


# --- importance correction against the rollout engine ---------------------------------------
# log pi_old/pi_rollout per token [n] -> the log weight each token uses
IS_LEVELS = {
    "token": lambda lw, tok: lw,
    "sequence": seq_sum,  # the product of the sequence's token ratios
    "geometric": seq_mean,
}  # its geometric mean: length-normalised, like GSPO's ratio


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


def importance_weights(
    logp_old,
    logp_rollout,
    seq_ids=None,
    *,
    level="token",
    correction="tis",
    tis_cap=None,
    is_mask_low=0.5,
    is_mask_high=2.0,
):
    """The detached weight the loss multiplies each token's policy term by: [N]."""
    hp = dict(tis_cap=tis_cap, is_mask_low=is_mask_low, is_mask_high=is_mask_high)
    return IS_CORRECTIONS[correction](importance_ratio(logp_old, logp_rollout, seq_ids, level), hp)


def prepare_tokens(logp_old, advantages, mask, seq_ids, logp_rollout, logp_ref, *, agg, normalizer, dtype, hp):
    """Everything per token that does not depend on logp: detached, zero at masked tokens."""
    m = mask.bool()

    def clean(x):  # where, not *, so garbage (NaN, -inf) at masked tokens cannot leak
        return None if x is None else torch.where(m, x.detach().to(dtype), 0.0)

    mf = m.to(dtype)
    tok = {
        "mask": m,
        "adv": clean(advantages),
        "logp_old": clean(logp_old),
        "logp_ref": clean(logp_ref),
        "logp_rollout": clean(logp_rollout),
        "is_w": None,
        "agg_w": _agg_weights(agg, mf, seq_ids, normalizer),
        **_seq_info(mf, seq_ids),
    }
    if logp_rollout is not None and logp_old is not None:
        tok["is_w"] = _is_weight(tok["logp_old"], tok, hp)
    return tok


def token_losses(logp, entropy, tok, **hp):
    """Per-token contributions [n] with aggregation weights applied; their sum is the loss."""
    m = tok["mask"]
    logp = torch.where(m, logp, 0.0)  # [n]
    old = tok["logp_old"] if tok["logp_old"] is not None else logp.detach()
    spec = POLICY_LOSSES[hp["policy_loss"]]
    total = spec.term(logp, old, tok["adv"], tok, loss_params(spec, hp))  # [n]
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

    ratio_*: the ratio the loss reports (its spec's `ratio`: per token; GSPO's sequence ratio on each
    of its tokens). clip_frac_low / _high: share of tokens its spec's `clip_fracs` counts (PPO: the
    gradient the lower (r < 1 - eps_low, A < 0) / upper (r > 1 + eps_high, A > 0) clip zeroes;
    CISPO: the weight its bounds truncate); clip_frac_dual likewise (r > c, A < 0).
    """
    m = tok["mask"]
    n = m.sum().clamp(min=1)

    def mean(x):
        return torch.where(m, x.float(), 0.0).sum() / n

    logp = torch.where(m, logp, 0.0)
    old = tok["logp_old"] if tok["logp_old"] is not None else logp
    spec = POLICY_LOSSES[hp["policy_loss"]]
    p = loss_params(spec, hp)
    ratio = spec.ratio(logp, old, tok)
    adv, any_tok = tok["adv"], m.any()
    low, high = spec.clip_fracs(ratio, adv, p)
    out = {
        "clip_frac_low": mean(low),
        "clip_frac_high": mean(high),
        "ratio_mean": mean(ratio),
        "ratio_min": torch.where(any_tok, torch.where(m, ratio, torch.inf).amin(), 0.0),
        "ratio_max": torch.where(any_tok, torch.where(m, ratio, -torch.inf).amax(), 0.0),
    }
    if getattr(p, "dual_clip", None):
        out["clip_frac_dual"] = mean((ratio > p.dual_clip) & (adv < 0))
    if tok["logp_ref"] is not None:
        out["kl_mean"] = mean(KL_ESTIMATORS[hp["kl_type"]]((tok["logp_ref"] - logp).clamp(-20.0, 20.0)))
    if entropy is not None:
        out["entropy_mean"] = mean(entropy)
    if tok["logp_rollout"] is not None:
        w = tok["is_w"] if tok["is_w"] is not None else _is_weight(old, tok, hp)
        out["tis_mean"] = mean(w)
    return out


def check_hparams(hp, agg, logp_ref, entropy_given):
    for name, table, key in (
        ("agg", AGGREGATORS, agg),
        ("kl_type", KL_ESTIMATORS, hp["kl_type"]),
        ("tis_level", IS_LEVELS, hp["tis_level"]),
        ("is_correction", IS_CORRECTIONS, hp["is_correction"]),
    ):
        if key not in table:
            raise ValueError(f"{name}={key!r}; choose from {sorted(table)}")
    spec = policy_loss(hp["policy_loss"])
    own = spec.knobs()
    foreign = sorted(k for k in param_names() - set(own) if hp.get(k))  # None, 0: not given
    if foreign:
        raise ValueError(
            f"policy_loss={spec.name} takes no {', '.join(foreign)} (its hyperparameters: {', '.join(own) or 'none'})"
        )
    params = loss_params(spec, hp)
    if hasattr(params, "check"):
        params.check()
    if hp["kl_coef"] != 0.0 and logp_ref is None:
        raise ValueError("kl_coef != 0 needs logp_ref")
    if hp["entropy_coef"] != 0.0 and not entropy_given:
        raise ValueError("entropy_coef != 0 needs entropy")
    if not 0.0 <= hp["is_mask_low"] <= 1.0 <= hp["is_mask_high"]:
        raise ValueError("is_mask_low must be in [0, 1] and is_mask_high >= 1")


def ppo_loss(
    logp,
    logp_old,
    advantages,
    mask,
    *,
    seq_ids=None,
    logp_rollout=None,
    logp_ref=None,
    entropy=None,
    policy_loss="ppo",
    is_correction="tis",
    tis_cap=None,
    tis_level="token",
    is_mask_low=0.5,
    is_mask_high=2.0,
    kl_coef=0.0,
    kl_type="k3",
    entropy_coef=0.0,
    agg="token_mean",
    normalizer=None,
    **params,
):
    """agg(w * L) + kl_coef * agg(KL) - entropy_coef * agg(entropy), all token tensors [N].

    L: the policy loss's term (ppo: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), min'd with
    -A * dual_clip where A < 0); `params`: its own hyperparameters (ppo, gspo, gspo_token: eps_low,
    eps_high, dual_clip; cispo: cispo_clip_low, cispo_clip_high; gmpo: eps_low, eps_high), each
    loss's defaults where not given; w (only with logp_rollout): the detached IS weight from
    exp(logp_old - logp_rollout) at tis_level, truncated at tis_cap (is_correction="tis") or
    0 outside [is_mask_low, is_mask_high] (is_correction="mask").
    Returns (loss, metrics: dict of detached 0-d tensors).
    """
    unknown = set(params) - param_names()
    if unknown:
        raise TypeError(f"ppo_loss: unexpected arguments {sorted(unknown)}")
    hp = dict(
        params,
        policy_loss=policy_loss,
        is_correction=is_correction,
        tis_cap=tis_cap,
        tis_level=tis_level,
        is_mask_low=is_mask_low,
        is_mask_high=is_mask_high,
        kl_coef=kl_coef,
        kl_type=kl_type,
        entropy_coef=entropy_coef,
    )
    check_hparams(hp, agg, logp_ref, entropy is not None)
    logp_old = logp.detach() if logp_old is None else logp_old
    tok = prepare_tokens(
        logp_old,
        advantages,
        mask,
        seq_ids,
        logp_rollout,
        logp_ref,
        agg=agg,
        normalizer=normalizer,
        dtype=torch.promote_types(logp.dtype, torch.float32),
        hp=hp,
    )
    loss = token_losses(logp, entropy, tok, **hp).sum()
    return loss, loss_metrics(logp.detach(), None if entropy is None else entropy.detach(), tok, **hp)
