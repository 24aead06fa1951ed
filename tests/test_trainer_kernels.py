"""The trainer's loss providers agree: Liger's fused GRPO loss (rescaled to our explicit
normaliser) vs our chunked torch kernel, through the trainer's own module on a tiny Qwen2."""

import pytest
import torch
import transformers

from hybridrl.algorithms import POLICY_LOSSES
from hybridrl.engines.policy import TokenLogprobs
from hybridrl.kernels.fused_loss import _LOSS_DEFAULTS

OWN = {"eps_low": 0.2, "eps_high": 0.28, "cispo_clip_high": 0.1}  # the policy losses' own hyperparameters

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=40,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2ForCausalLM(cfg).float()


def rows():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 40, (4, 9), generator=g)
    lengths = torch.tensor([9, 7, 8, 5])
    attn = torch.arange(9)[None] < lengths[:, None]
    loss_mask = attn.clone()
    loss_mask[:, :4] = False  # 4 prompt tokens per row, the rest is completion
    return tokens, attn, loss_mask


def loss_and_grads(provider, agg, off_policy, normalizer_scale=1.0, row_idx=None, policy_loss="ppo", mask_is=False):
    model = tiny_model()
    module = TokenLogprobs(model, provider, chunk=16, max_len=5)
    tokens, attn, mask = rows()
    # an older policy: current log-probs shifted by a fixed (row, position) pattern, ratios 0.7..1.4
    shift = 0.07 * (torch.arange(4 * 8).view(4, 8) % 11 - 5).float()  # [rows, T-1]
    if row_idx is not None:
        tokens, attn, mask, shift = tokens[row_idx], attn[row_idx], mask[row_idx], shift[row_idx]
    sel = mask[:, 1:]
    seq_ids = torch.arange(len(tokens))[:, None].expand_as(sel)[sel]
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])[row_idx if row_idx is not None else slice(None)]
    n_tok = int(sel.sum())
    full_norm = {"token_mean": 17.0, "seq_mean_token_mean": 4.0, "seq_mean_token_sum_norm": 20.0}[agg]
    logp_old = None
    if off_policy:
        with torch.no_grad():
            logp, _ = module(tokens, attn, mask, 1.0)
        logp_old = logp + shift[sel]
    logp_rollout = None
    if mask_is:  # vLLM's log-probs: the pattern reversed, so pi_old / pi_vllm spreads over ~0.5..2
        with torch.no_grad():
            logp, _ = module(tokens, attn, mask, 1.0)
        logp_rollout = logp - shift.flip(1)[sel] * 1.5
    policy_loss_knobs = POLICY_LOSSES[policy_loss].knobs()  # each loss takes its own hyperparameters only
    loss, metrics, _, _ = module(
        tokens,
        attn,
        mask,
        1.0,
        dict(
            _LOSS_DEFAULTS,
            logp_old=logp_old,
            advantages=adv[seq_ids],
            mask=torch.ones(n_tok),
            seq_ids=seq_ids,
            logp_rollout=logp_rollout,
            policy_loss=policy_loss,
            **{k: v for k, v in OWN.items() if k in policy_loss_knobs},
            is_correction="mask" if mask_is else "tis",
            tis_level="geometric",
            is_mask_low=0.8,
            is_mask_high=1.25,
            agg=agg,
            normalizer=full_norm * normalizer_scale,
        ),
    )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_liger_matches_torch_provider(agg, off_policy):
    ref_loss, ref_grads = loss_and_grads("torch", agg, off_policy)
    loss, grads = loss_and_grads("liger", agg, off_policy)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "policy_loss,agg,mask_is",
    [
        ("gspo", "seq_mean_token_mean", False),
        ("gspo", "token_mean", True),
        ("cispo", "token_mean", False),
        ("cispo", "token_mean", True),
        ("ppo", "token_mean", True),
    ],
)
def test_liger_matches_torch_provider_gspo_cispo_masked_is(policy_loss, agg, mask_is):
    """GSPO (Liger's sequence-level importance sampling), CISPO (its loss_type cispo, upper bound
    1 + 0.1 here so that it truncates) and the masked IS weight (its vllm_is_ratio), off-policy."""
    ref_loss, ref_grads = loss_and_grads("torch", agg, True, policy_loss=policy_loss, mask_is=mask_is)
    loss, grads = loss_and_grads("liger", agg, True, policy_loss=policy_loss, mask_is=mask_is)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_liger_micro_batches_sum_to_the_batch(agg):
    # with the global normaliser, the losses of two halves add up to the loss of the whole
    whole, _ = loss_and_grads("liger", agg, True)
    halves = sum(loss_and_grads("liger", agg, True, row_idx=torch.tensor(i))[0] for i in ([0, 1], [2, 3]))
    torch.testing.assert_close(halves, whole, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("attr,value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.5)])
def test_models_that_transform_their_logits_are_refused_with_a_clear_error(attr, value):
    """The fused path reads the head's weight, not lm_head's forward: a model that softcaps or scales
    its logits (Gemma 2, Cohere) would be scored wrong, so it is refused with a one-line UserError."""
    from hybridrl.core.config import UserError

    model = tiny_model()
    setattr(model.config, attr, value)
    with pytest.raises(UserError, match=f"applies {attr}={value} to its logits.*use a model without it") as e:
        TokenLogprobs(model, "torch", chunk=16)
    assert "\n" not in str(e.value)
