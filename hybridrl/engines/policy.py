"""The policy's forward: an HF causal LM -> log-probs (and the loss) of the completion tokens.

`TokenLogprobs` bypasses the model's LM head: the base model returns hidden states, and only the
rows that predict completion tokens go through `kernels.logprob` / `kernels.ppo_loss` with the
head's weight, so no [tokens x vocab] logits tensor is ever built (prompt positions need no logits
at all). `share_prompt` decides whether a group's prompt is computed once for its rows, and
`module_inputs` lays a micro-batch out for it. The trainer (trainer.py) and the reference
(reference.py) both run their models through this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from hybridrl.algorithms import policy_loss
from hybridrl.core.config import Config, UserError
from hybridrl.core.models import is_native, plain_cache
from hybridrl.data import images as image_io
from hybridrl.data.batch import Batch, Shared
from hybridrl.engines import ulysses
from hybridrl.engines.zero_engine import autocast
from hybridrl.kernels.distill_kl import distill_divergence
from hybridrl.kernels.fused_loss import fused_logprob_ppo_loss
from hybridrl.kernels.liger_loss import liger_ppo_loss
from hybridrl.kernels.logprob import logprob_entropy
from hybridrl.kernels.ppo_loss import agg_weights, importance_weights

log = logging.getLogger("hybridrl")
# the warning when train.share_prompt=on cannot be honoured (bench/peers.py reads it from the run's output)
SHARE_PROMPT_REFUSED = "train.share_prompt=on: not with"
# attention implementations that read packed samples from position_ids (transformers' masking_utils)
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


class TokenLogprobs(nn.Module):
    """HF causal LM -> log-prob and entropy of the masked tokens, through the fused kernel. The
    trainer's engine wraps it; the reference policy (reference.py) scores with it too."""

    def __init__(
        self, hf: nn.Module, provider: str, chunk: int, max_len: int | None = None, autocast: torch.dtype | None = None
    ):
        """`autocast`: the dtype the forward (and so its backward) computes in over float32 weights
        (zero_engine.precision: train.precision=amp), None to compute in the weights' own dtype."""
        super().__init__()
        self.hf, self.provider, self.chunk, self.max_len, self.autocast = hf, provider, chunk, max_len, autocast
        self.sp: ulysses.Group | None = None  # the trainer's sequence-parallel group (train.sequence_parallel_size > 1)
        # a vision-language model's placeholder ban, [V]: the logit bias vLLM samples with (images.ban), so
        # that both engines score sampled tokens under the same distribution; None for a text model
        self.ban = image_io.ban(hf.config, hf.get_output_embeddings().out_features)
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(hf.config, attr, None) not in (None, 1.0):
                raise UserError(
                    f"{type(hf).__name__} applies {attr}={getattr(hf.config, attr)} to its logits, which "
                    "the fused log-prob path (it bypasses the LM head) does not: such models are not "
                    "supported yet; use a model without it"
                )

    def forward(self, *args, **kw):
        with autocast(self.hf.get_output_embeddings().weight.device.type, self.autocast):
            return self._forward(*args, **kw)

    def _forward(
        self,
        tokens,
        attention_mask,
        loss_mask,
        temperature: float,
        loss: dict | None = None,
        position_ids=None,
        shared: dict | None = None,
        shard: dict | None = None,
        distill: dict | None = None,
        keep_hidden: bool = False,
        images: dict | None = None,
        ban: bool = True,
    ):
        """Without `loss`: (logp [N], entropy [N]) of the masked tokens, and their final hidden states
        [N, d] with `keep_hidden` (a teacher's, for algo.distill_loss full). With `loss` (ppo_loss's
        per-token tensors and knobs): (loss, metrics, logp, entropy) from the fused kernel, which
        produces the logits' gradient in the same pass; with `distill` (the teacher's hidden states
        of the same tokens, its head, beta, coef) plus coef x the aggregated full-vocabulary
        divergence. Packed rows (`Batch.packed()`) come with position_ids and attention_mask=None;
        the shared-prompt layout (`Batch.shared()`, as a dict) comes alone, tokens, attention_mask
        and loss_mask None. Sequence parallelism (`ulysses.shard`, as a dict) gives this rank's slice
        of a packed row in tokens and position_ids, and `shard` the slice's next-token targets and
        loss positions and the whole row's layout, which its attention reads. `images` (a
        vision-language batch's RowImages.inputs(): pixel_values, image_grid_thw) go to the model,
        which fills the rows' image tokens with the tower's features; position_ids then hold the
        multimodal positions too ([4, 1, L] packed, [4, B, T] padded). `ban`: score under the
        placeholder ban vLLM samples with (self.ban); off for a prompt's tokens as vLLM scores them
        (the probe's prompt_logprobs, which no logit bias touches)."""
        ulysses.ACTIVE = (
            None if shard is None else ulysses.Active(self.sp, shard["segments"], shard["full_position_ids"])
        )
        if shard is not None:
            hidden = self.hf.base_model(
                input_ids=tokens, position_ids=position_ids, use_cache=False
            ).last_hidden_state  # [1, S, d]: this rank's slice
            sel, targets = shard["sel"], shard["targets"]  # [1, S]: taken from the whole row
        elif shared is not None:
            s = Shared(**shared)
            hidden, sel, targets = (
                self._shared_hidden(s, images),
                s.loss_mask,
                s.completions,
            )  # [B, C, d], [B, C], [B, C]
        else:
            # use_cache=False: a KV cache is useless here, and transformers only looks for packed
            # sequences in position_ids when there is none (masking_utils._preprocess_mask_arguments)
            hidden = self.hf.base_model(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **(images or {}),
            ).last_hidden_state[:, :-1]
            sel, targets = loss_mask[:, 1:], tokens[:, 1:]  # [B, T-1]: position t predicts token t+1
        h = hidden[sel]  # [N, d]
        y = targets[sel]  # [N]
        head = self.hf.get_output_embeddings()
        bias = head.bias
        if ban and self.ban is not None:
            bias = self.ban.to(head.weight.device) + (0.0 if bias is None else bias)
        if self.provider == "liger" and loss is not None:
            return self._liger(hidden, head, targets, sel, h, y, temperature, loss, bias)
        if shard is not None and not len(y):  # a slice that predicts no loss token (a prompt's): zeros, but one
            # that reaches every parameter, so that backward runs every layer's all-to-all and ZeRO sees a gradient
            empty = h.new_zeros(0, dtype=torch.float32)
            if loss is None:
                return empty, empty
            zero = 0.0 * hidden.sum() + sum(0.0 * p.sum() for p in head.parameters())
            return zero, {}, empty, empty
        kw = dict(
            temperature=temperature,
            bias=bias,
            chunk_size=self.chunk,
            provider="torch" if self.provider == "liger" else self.provider,
        )
        if loss is None:
            logp, entropy = logprob_entropy(h, head.weight, y, **kw)
            return (logp, entropy, h) if keep_hidden else (logp, entropy)
        out = fused_logprob_ppo_loss(h, head.weight, y, **kw, **loss)
        if distill is not None:  # the teacher's whole distribution at every loss token (kernels/distill_kl.py)
            d = distill_divergence(
                h, head.weight, distill["hidden"], distill["weight"], beta=distill["beta"], temperature=temperature
            )
            w = agg_weights(loss["agg"], loss["mask"], loss["seq_ids"], loss["normalizer"])
            metrics = {**out[1], "distill_div": d.detach().mean() if len(d) else d.new_zeros(())}
            out = (out[0] + distill["coef"] * (w * d).sum(), metrics, *out[2:])
        if shard is not None:  # backward must reach every layer's all-to-all on every rank, also one whose
            out = (out[0] + 0.0 * hidden.sum(), *out[1:])  # slice holds no loss token (they are collectives)
        return out

    def _shared_hidden(self, s: Shared, images: dict | None = None) -> torch.Tensor:
        """[B, C, d] hidden states that predict each row's completion tokens, its prompt computed once
        per group: the distinct prompts run first and keep their KV cache (with its autograd graph),
        which is gathered to the rows and extended by the completions; the prompt's last hidden
        state predicts the first completion token. Backward sums each prompt's gradient over its rows:
        the same loss and gradients as running every row whole, for 1/rows of the prompt's compute.
        A vision-language batch's prompts run with their `images` and multimodal positions, and the
        completions continue from theirs."""
        body = self.hf.base_model
        G, P = s.prompts.shape
        prompt_mask = (torch.arange(P, device=s.prompts.device)[None] < s.prompt_lens[:, None]).long()
        prompt_pos, comp_pos = None, s.position_ids
        if s.prompt_mrope is not None:  # [4, G, P] and [4, B, C]: the text position, then t, h, w
            text = torch.arange(P, device=s.prompts.device).expand(1, G, P)
            prompt_pos = torch.cat([text, s.prompt_mrope.permute(2, 0, 1)])
            comp_pos = torch.cat([s.position_ids[None], s.completion_mrope.permute(2, 0, 1)])
        out = body(
            input_ids=s.prompts, attention_mask=prompt_mask, position_ids=prompt_pos, use_cache=True, **(images or {})
        )
        cache = out.past_key_values
        cache.batch_select_indices(s.group)  # [G, ...] -> [B, ...]: an index, differentiable
        comp = body(
            input_ids=s.completions,
            attention_mask=s.attention_mask,
            position_ids=comp_pos,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # [B, C, d]
        last = out.last_hidden_state[torch.arange(len(s.prompts), device=comp.device), s.prompt_lens - 1]  # [G, d]
        return torch.cat([last[s.group][:, None], comp[:, :-1]], 1)

    def _liger(self, hidden, head, targets, sel, h, y, temperature, loss, bias):
        """Liger's fused GRPO loss on whole rows (it takes [B, T, d]: the positions that predict a next
        token); our per-token inputs are scattered back to rows. logp is computed first without grad:
        for the metrics, and for the IS weight when the pass is on-policy (logp_old None)."""
        seq_ids = loss["seq_ids"]
        with torch.no_grad():
            logp, entropy = logprob_entropy(h, head.weight, y, temperature, bias, provider="torch")

        def rows(x):  # [N] -> [B, T-1], zero off the completion tokens
            out = torch.zeros(sel.shape, device=h.device)
            out[sel] = x.float()
            return out

        adv = torch.zeros(len(hidden), device=h.device).index_put_((seq_ids,), loss["advantages"].float())  # [B]
        old = None if loss["logp_old"] is None else rows(loss["logp_old"])
        is_w = None
        if loss["logp_rollout"] is not None:  # TIS or masked IS: a detached weight per token
            is_w = rows(
                importance_weights(
                    logp if loss["logp_old"] is None else loss["logp_old"],
                    loss["logp_rollout"],
                    seq_ids,
                    level=loss["tis_level"],
                    correction=loss["is_correction"],
                    tis_cap=loss["tis_cap"],
                    is_mask_low=loss["is_mask_low"],
                    is_mask_high=loss["is_mask_high"],
                )
            )
        value, metrics = liger_ppo_loss(
            hidden,
            head.weight,
            targets,
            sel,
            adv,
            old,
            temperature,
            bias,
            policy_loss=loss["policy_loss"],
            is_weights=is_w,
            agg=loss["agg"],
            normalizer=loss["normalizer"],
            **{k: loss[k] for k in policy_loss(loss["policy_loss"]).knobs() if k in loss},
            max_len=self.max_len,
        )
        return value, metrics, logp, entropy


def kernel_provider(cfg: Config) -> str:
    """train.kernels as the trainer runs it: auto = chunked torch (see schema's train.kernels)."""
    return cfg.train.kernels if cfg.train.kernels != "auto" else "torch"


def packs(cfg: Config, provider: str, attn_implementation: str, native: bool) -> bool:
    """train.packing: on when set (auto: with flash-attention, whose varlen kernels compute no padding),
    unless Liger's loss (it takes [B, T, d] rows and aggregates per row), an attention that cannot read
    packed samples from position_ids, or a model class not transformers' own (remote code may build its
    own masks, blind to packing) rules it out."""
    want = cfg.train.packing == "on" or (cfg.train.packing == "auto" and attn_implementation.startswith("flash_"))
    want = want or cfg.train.sequence_parallel_size > 1  # its slices are cut from one packed row
    return want and provider != "liger" and attn_implementation in PACKABLE_ATTENTION and native


def share_prompt_refusals(
    cfg: Config, provider: str, attn_implementation: str, packing: bool, *, native: bool, plain_cache: bool, name: str
) -> list[str]:
    """Why train.share_prompt (on or auto) is not done for a model of class `name`; [] when it is."""
    return [
        reason
        for reason, bad in (
            (f"kernels={provider}", provider == "liger"),
            (f"attention {attn_implementation}", attn_implementation not in ("sdpa", "eager")),
            ("packing", packing),
            ("gradient checkpointing", cfg.model.gradient_checkpointing),
            (f"{name} (not transformers' own, or a sliding-window cache)", not plain_cache or not native),
            ("ZeRO-3 (auto)", cfg.train.share_prompt == "auto" and cfg.train.zero_stage == 3),
            ("sequence parallelism", cfg.train.sequence_parallel_size > 1),
        )
        if bad
    ]


def share_prompt(cfg: Config, hf: nn.Module, provider: str, attn_implementation: str, packing: bool) -> bool:
    """train.share_prompt: compute a group's prompt once for its rollout.n rows (TokenLogprobs._shared_hidden).
    It needs a transformers model whose KV cache grows by concatenation (no sliding window), sdpa or eager
    attention (their masks take a padded prompt followed by the completion; flash-attention's unpadding
    assumes left padding), our own loss kernels (Liger takes whole rows), no packing and no gradient
    checkpointing (which turns the cache off). auto: also not under ZeRO-3, not yet measured there."""
    want = cfg.train.share_prompt
    if want == "off":
        return False
    why = share_prompt_refusals(
        cfg,
        provider,
        attn_implementation,
        packing,
        native=is_native(type(hf)),
        plain_cache=plain_cache(hf.config),
        name=type(hf).__name__,
    )
    if why and want == "on":  # asked for by name: say why it is not done
        log.warning(SHARE_PROMPT_REFUSED + " %s; every row computes its own prompt", ", ".join(why))
    return not why


@dataclass(frozen=True)
class Layout:
    """How the trainer runs its micro-batches: the log-prob/loss provider (train.kernels), packed rows
    (train.packing), a group's prompt computed once (train.share_prompt). `layout` decides it from the
    config and the model's facts before any engine starts, as the Trainer does once it holds the model
    (packs, share_prompt), so that the run's printed recipe says what the trainer uses."""

    kernels: str
    packing: bool
    share_prompt: bool

    def recipe(self, cfg: Config) -> dict[str, tuple[str, str]]:
        """For recipe.describe: each choice left to the trainer (auto), or asked for and not done
        (refused), as key -> (value, source)."""
        out = {}
        for key, asked, got in (
            ("train.kernels", cfg.train.kernels, self.kernels),
            ("train.packing", cfg.train.packing, "on" if self.packing else "off"),
            ("train.share_prompt", cfg.train.share_prompt, "on" if self.share_prompt else "off"),
        ):
            if asked == "auto" or asked != got:
                out[key] = (got, "auto" if asked == "auto" else "refused")
        return out


def layout(
    cfg: Config, attn_implementation: str, *, native: bool = True, plain_cache: bool = True, name: str = "the model"
) -> Layout:
    """The trainer's Layout for a model with these facts (models.ModelInfo's native and plain_cache)."""
    provider = kernel_provider(cfg)
    packing = packs(cfg, provider, attn_implementation, native)
    share = cfg.train.share_prompt != "off" and not share_prompt_refusals(
        cfg, provider, attn_implementation, packing, native=native, plain_cache=plain_cache, name=name
    )
    return Layout(provider, packing, share)


def module_inputs(mb: Batch, packing: bool, share: bool) -> tuple[tuple, dict]:
    """TokenLogprobs' (tokens, attention_mask, loss_mask) and keyword inputs for a micro-batch: packed
    (one row, no padding computed), shared-prompt (each distinct prompt computed once, when rows share
    one), or right-padded rows. The policy and the reference lay their micro-batches out alike.
    The packed and shared layouts are built on the host and moved once: built on a GPU, their
    Python loops over rows would wait on the device at every row."""
    if packing or share:
        dev, host = mb.tokens.device, mb.to("cpu")  # on a CPU run, the same tensors

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, non_blocking=True)

        if packing:
            p = host.packed()
            kw = dict(position_ids=move(p.position_ids), **_images(mb))
            return (move(p.tokens), None, move(p.loss_mask)), kw
        s = host.shared()
        if s is not None and len(s.prompts) < len(mb):
            first = torch.tensor([rows[0] for rows in host.prompt_groups()])  # each prompt's images, in order
            kw = dict(shared={k: move(v) for k, v in s._asdict().items() if v is not None})
            return (None, None, None), kw | _images(mb.select(first) if mb.images is not None else mb)
    if mb.mrope is not None:  # a vision-language batch: its positions, and its rows' images
        return (mb.tokens, mb.attention_mask(), mb.loss_mask), dict(position_ids=mb.position_ids(), **_images(mb))
    return (mb.tokens, mb.attention_mask(), mb.loss_mask), {}


def _images(mb: Batch) -> dict:
    """TokenLogprobs' images= of a micro-batch whose rows have any; {} otherwise."""
    got = mb.images.inputs() if mb.images is not None else {}
    return dict(images=got) if got else {}
