"""Truncated importance sampling through the trainer's module: the weight scales the surrogate
and carries no gradient (the pure function is tested in tests/kernels/test_ppo_loss.py).

On-policy (logp_old = logp, ratio 1, no clipping) the surrogate is -A per token, so a detached
weight w_i on sequence i gives exactly the loss and gradients of advantages w_i * A_i without
TIS. A weight that let gradient through exp(logp - logp_rollout) would add d w / d logp = w to
each token's gradient and fail the comparison.
"""

import math

import pytest
import torch

from helpers.packing import rows, trainer

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def run(packing, batch, *, tis_level=None, logp_rollout=None, advantages=None, on_policy=False):
    t = trainer(packing)
    sel = batch.loss_mask
    seq_ids = torch.arange(len(batch))[:, None].expand_as(sel)[sel]  # [N]
    adv = batch.advantages if advantages is None else advantages
    loss, metrics, _, _ = t._forward(
        batch,
        1.0,
        loss=dict(
            logp_old=None if on_policy else batch.logp_old[sel],
            advantages=adv[seq_ids],
            mask=torch.ones(len(seq_ids)),
            seq_ids=seq_ids,
            logp_rollout=logp_rollout,
            eps_low=0.2,
            eps_high=0.28,
            dual_clip=None,
            tis_cap=2.0 if tis_level else None,
            tis_level=tis_level or "token",
            entropy_coef=0.0,
            agg="token_mean",
            normalizer=None,
        ),
    )
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in t.engine.named_parameters()}


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize(
    "tis_level,log_c,on_policy",
    [
        ("token", math.log(1.5), False),
        ("token", math.log(3.0), False),
        ("sequence", math.log(1.1), False),
        ("token", math.log(1.5), True),
    ],
)  # logp_old=None: the kernel takes logp.detach() as the old policy
def test_tis_weight_scales_the_loss_and_carries_no_gradient(packing, tis_level, log_c, on_policy):
    batch = rows()
    batch.logp_old = trainer(packing).logprobs(batch, 1.0)  # the policy itself: ratio 1
    sel = batch.loss_mask
    n_tok = sel.sum(1).float()  # [B] completion tokens: 5, 1, 3, 5, 2
    # vLLM's log-probs lower than the trainer's by log c on every token:
    #   token level:    w = min(c, 2)              -> 1.5, or 3 capped at 2
    #   sequence level: w_i = min(c ** n_i, 2)     -> 1.1 ** (5, 1, 3, 5, 2) = 1.61, 1.1, 1.33, 1.61, 1.21
    rollout = (batch.logp_old[sel] - log_c).requires_grad_()
    w = (
        (log_c * n_tok).exp().clamp(max=2.0)
        if tis_level == "sequence"
        else torch.full((len(batch),), min(math.exp(log_c), 2.0))
    )  # [B]
    loss, metrics, grads = run(packing, batch, tis_level=tis_level, logp_rollout=rollout, on_policy=on_policy)
    ref_loss, _, ref_grads = run(packing, batch, advantages=batch.advantages * w)
    assert rollout.grad is None  # the weight is a constant to autograd
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(metrics["tis_mean"], (w * n_tok).sum() / n_tok.sum(), rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "over,needed",
    [
        ({"algo.tis_cap": 2.0}, False),  # one update: its own forward is pi_old (the case above, on_policy)
        ({"algo.is_correction": "mask"}, False),
        ({"algo.tis_cap": 2.0, "train.minibatches": 2}, True),  # the second update's pi_old is not its own
        ({"algo.tis_cap": 2.0, "model.lora_rank": 8, "model.lora_dropout": 0.1}, True),  # dropout: not pi_old
        ({"algo.kl_coef": 0.01, "algo.kl_in": "reward"}, True),
        ({}, False),
    ],
)
def test_importance_correction_with_one_update_runs_no_separate_pi_old_forward(over, needed):
    over = {"train.minibatches": 1, **over}  # the recipes' setting (the demo's default is 2)
    """The step's own forward gives pi_old's log-probs when one update consumes the rollout: a
    separate no-grad forward over the batch (one more forward per step) is spent only where it differs."""
    from hybridrl.core import config
    from hybridrl.engines.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg = config.load(None, over)
    t.peft = object() if t.cfg.model.lora_rank else None
    assert t.needs_old_logprobs is needed


def test_the_step_reports_partial_weights_as_the_loop_did():
    """Without a separate pi_old the trainer reports partial rollouts' IS weights from the update
    (weight_metrics over the tokens it trained): the loop's figures on the same log-probs."""
    from hybridrl.data import partial

    g = torch.Generator().manual_seed(0)
    old, behaviour = -torch.rand(3, 6, generator=g), -torch.rand(3, 6, generator=g)
    mask = torch.rand(3, 6, generator=g) > 0.3
    stale = torch.rand(3, 6, generator=g) > 0.5
    w = (old[mask] - behaviour[mask]).exp()
    assert partial.weight_metrics(w, stale[mask]) == partial.is_metrics(old, behaviour, mask, stale)
