"""The one batch type that flows from rollout to trainer: padded token rows plus per-row data, and
the rollout's Sample (one completion) it is built from.

Position t of a row holds token t; `loss_mask[b, t]` marks completion tokens, whose log-prob
log p(tokens[b, t] | tokens[b, :t]) the trainer computes (in a multi-turn episode only the
assistant's: environment tokens inside the completion are context, like the prompt). Rows are right-padded, so position
ids are 0..len-1 in both engines. `Batch.packed()` lays the rows end to end without padding
(`train.packing`: on by default with flash-attention). `Batch.shared()` lays them out as their distinct
prompts plus each row's completion (`train.share_prompt`: a group's prompt is computed once).
A vision-language batch also carries each row's images (`RowImages`: the pixels its prompt's
placeholders are filled from) and its multimodal rotary positions (`mrope`, data/images.py), which
both layouts hand to the model beside the text positions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from hybridrl.data.images import Pixels


@dataclass
class Sample:
    """One completion as the rollout returns it (engines/rollout.py), before it joins a Batch."""

    prompt_idx: int  # index into the prompt list passed to generate
    token_ids: list[int]  # completion tokens
    logprobs: list[float]  # vLLM's log-prob of each completion token (after temperature)
    finished: bool  # stopped on EOS / stop token rather than on the length limit
    sample_idx: int = 0  # which of the prompt's n samples
    # multi-turn episodes (run/multiturn.py): 1 on the assistant's tokens, 0 on the environment's, whose
    # logprobs are 0.0 placeholders; None = every token is the model's (single turn)
    loss_mask: list[int] | None = None
    env_reward: float = 0.0  # the environment's rewards, summed over the episode's turns
    # MoE: the experts vLLM routed each token of prompt + completion to, [T, layers, k] int16, -1 where
    # unknown (engines/routing.py); None for a dense model or where they could not be recorded
    routes: torch.Tensor | None = None
    # partial rollouts (data/partial.py): the policy version (optimizer updates before it) that sampled
    # each completion token; None = all by the version of this step
    versions: list[int] | None = None
    # the prompt's ids as vLLM ran them where they are not its Prompt's: a vision-language prompt's, each
    # image's placeholder expanded into its patch tokens (data/images.py), and a multi-turn episode's,
    # rendered from its environment's reset; None for a text prompt sent as it is
    prompt_ids: list[int] | None = None
    # a vision-language model's multi-turn episode: its images, the prompt's then its environment turns',
    # whose expanded runs `token_ids` holds (run/multiturn.py); () otherwise (the prompt's own are its Prompt's)
    images: tuple = ()


class Packed(NamedTuple):
    """A batch's rows laid end to end in one row of sum(lengths) tokens, no padding."""

    tokens: torch.Tensor  # [1, L] long
    # [1, L] long, 0..len-1 within each sample; with images [4, 1, L]: those, then t, h, w (Batch.mrope)
    position_ids: torch.Tensor
    loss_mask: torch.Tensor  # [1, L] bool
    seq_ids: torch.Tensor  # [1, L] long, the batch row each token came from


class Shared(NamedTuple):
    """A batch's rows as their distinct prompts, each computed once, and every row's completion,
    which attends to its prompt through a KV cache. Position j of a completion row predicts
    `completions[:, j]`: j = 0 from the prompt's last token, j >= 1 from completion token j - 1."""

    prompts: torch.Tensor  # [G, P] long, right-padded
    prompt_lens: torch.Tensor  # [G] long
    group: torch.Tensor  # [B] long, the row's prompt
    completions: torch.Tensor  # [B, C] long, the tokens after the prompt, right-padded
    attention_mask: torch.Tensor  # [B, P + C] long: the row's prompt's real tokens, then its completion's
    position_ids: torch.Tensor  # [B, C] long, the row's prompt length + 0..C-1
    loss_mask: torch.Tensor  # [B, C] bool, completion positions that carry loss
    # a vision-language batch's multimodal positions (Batch.mrope): [G, P, 3] of the prompts, [B, C, 3]
    # of the completions; None for a text batch (the prompts' images: RowImages.inputs of `first`)
    prompt_mrope: torch.Tensor | None = None
    completion_mrope: torch.Tensor | None = None


@dataclass
class RowImages:
    """Each row's images as the model takes them (images.Pixels' values and grid), None for a row
    without: a prompt's rows hold the same tensors, moved once. A micro-batch's `inputs()` lay them
    out in row order, the order the model fills the rows' image tokens in (packed or padded)."""

    values: list[torch.Tensor | None]  # per row: [patches, D] float
    grids: list[torch.Tensor | None]  # per row: [images, 3] long
    # per row: its completion holds images too (a multi-turn episode's environment turns); [] = none does
    later: list[bool] = field(default_factory=list)

    def select(self, idx: torch.Tensor) -> "RowImages":
        rows = idx.tolist()
        later = [self.later[b] for b in rows] if self.later else []
        return RowImages([self.values[b] for b in rows], [self.grids[b] for b in rows], later)

    def to(self, device) -> "RowImages":
        moved: dict[int, torch.Tensor] = {}

        def move(t):
            return None if t is None else moved.setdefault(id(t), t.to(device))

        return RowImages([move(t) for t in self.values], [move(t) for t in self.grids], self.later)

    def key(self, b: int) -> int | None:
        """Which images row b's prompt holds (None: none): rows of one prompt share its tensor, so
        prompts of the same text with other images (one question asked of many images) stay apart."""
        return None if self.values[b] is None else id(self.values[b])

    def inputs(self) -> dict[str, torch.Tensor]:
        """pixel_values and image_grid_thw of the rows' images, in row order; {} if they have none."""
        rows = [(v, g) for v, g in zip(self.values, self.grids) if v is not None]
        if not rows:
            return {}
        return dict(pixel_values=torch.cat([v for v, _ in rows]), image_grid_thw=torch.cat([g for _, g in rows]))


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] long, prompt + completion, right-padded with 0
    lengths: torch.Tensor  # [B] long, real tokens per row
    loss_mask: torch.Tensor  # [B, T] bool, True on completion tokens that carry loss (not environment turns)
    advantages: torch.Tensor  # [B] float, one per sequence (broadcast over its tokens), or [B, T] per token
    logp_rollout: torch.Tensor  # [B, T] float, vLLM's log-prob of each completion token
    logp_old: torch.Tensor | None = None  # [B, T] float, trainer log-probs before this update
    logp_ref: torch.Tensor | None = None  # [B, T] float, the reference policy's log-probs (algo.kl_coef > 0)
    logp_teacher: torch.Tensor | None = None  # [B, T] float, the distillation teacher's log-probs (algo.teacher)
    hidden_teacher: torch.Tensor | None = None  # [B, T, d] its final hidden states (algo.distill_loss full)
    values: torch.Tensor | None = None  # [B, T] float, the critic's values before this update (gae)
    returns: torch.Tensor | None = None  # [B, T] float, the critic's targets (gae)
    routes: torch.Tensor | None = None  # [B, T, L, k] int16, MoE: vLLM's experts per token and layer, -1 = unknown
    stale: torch.Tensor | None = None  # [B, T] bool, partial rollouts: tokens an older policy sampled (data/partial.py)
    # vision-language rows: [B, T, 3] long, each token's multimodal rotary position (t, h, w), and the
    # rows' images; None for a text batch
    mrope: torch.Tensor | None = None
    images: RowImages | None = None

    @classmethod
    def from_rows(
        cls,
        prompts: list[list[int]],
        completions: list[list[int]],
        rollout_logprobs: list[list[float]],
        advantages: list[float],
        completion_masks: list[list[int] | None] | None = None,
        routes: list[torch.Tensor | None] | None = None,
        pixels: list[Pixels | None] | None = None,
    ) -> "Batch":
        """`completion_masks[b]`: 1 on the completion tokens that carry loss (a multi-turn episode's
        assistant tokens), 0 on context inside it (environment tokens); None = all of them.
        `routes[b]`: [len, L, k] the experts vLLM routed row b's tokens to (MoE); None = not recorded.
        `pixels[b]`: row b's images (images.Vision.pixels of its expanded prompt, or of its whole row where
        its completion holds images too, a multi-turn episode's); None = none."""
        p_len = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
        c_len = np.fromiter((len(c) for c in completions), np.int64, len(completions))
        lengths = p_len + c_len  # [B]
        pos = np.arange(int(lengths.max()))
        real = pos < lengths[:, None]  # [B, T]
        mask = real & (pos >= p_len[:, None])  # the completion's positions
        # filled in one pass each: boolean indexing walks rows in order, as the flattened lists do
        # (a small tensor per row pays torch's per-call overhead once per row, every step)
        flat = itertools.chain.from_iterable
        tokens = np.zeros(real.shape, np.int64)
        tokens[real] = np.fromiter(
            flat(x for p, c in zip(prompts, completions) for x in (p, c)), np.int64, int(lengths.sum())
        )
        logp = np.zeros(real.shape, np.float32)
        logp[mask] = np.fromiter(flat(rollout_logprobs), np.float32, int(c_len.sum()))
        if completion_masks and any(m is not None for m in completion_masks):
            comp = mask.copy()
            mask[comp] = np.fromiter(
                flat([1] * len(c) if m is None else m for m, c in zip(completion_masks, completions)),
                bool,
                int(c_len.sum()),
            )
            logp[~mask] = 0.0  # environment tokens' placeholders
        return cls(
            torch.from_numpy(tokens),
            torch.from_numpy(lengths),
            torch.from_numpy(mask),
            torch.tensor(advantages, dtype=torch.float32),
            torch.from_numpy(logp),
            routes=stack_routes(routes, real.shape[1]),
            **_with_images(pixels, lengths, p_len),
        )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, idx: torch.Tensor) -> "Batch":
        """Rows `idx`, trimmed to their longest row."""
        T = int(self.lengths[idx].max())

        def take(x):
            if x is None or isinstance(x, RowImages):
                return x and x.select(idx)
            return x[idx, :T] if x.dim() >= 2 else x[idx]

        return replace(self, **{f.name: take(getattr(self, f.name)) for f in fields(self)})

    def to(self, device) -> "Batch":
        return replace(
            self,
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                for f in fields(self)
            },
        )

    def attention_mask(self) -> torch.Tensor:  # [B, T]
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)[None] < self.lengths[:, None]

    def packed(self) -> Packed:
        """The rows end to end, position ids restarting at 0 per sample. Given position_ids and
        no attention mask, transformers' attention (sdpa, eager, flex: a block-diagonal causal
        mask; flash-attention-2: varlen cu_seqlens) keeps samples from attending to each other
        (masking_utils.find_packed_sequence_indices). Tokens keep their row-major order, so
        `loss_mask` selects the same tokens, in the same order, as the padded layout's."""
        if self.loss_mask[:, 0].any():  # its "previous position" would be the last sample's end
            raise ValueError("a row's first token cannot be a loss token when packing")
        real = self.attention_mask()  # [B, T]
        B, T = real.shape
        pos = torch.arange(T, device=real.device)[None].expand(B, T)
        rows = torch.arange(B, device=real.device)[:, None].expand(B, T)
        packed = Packed(*(x[real][None] for x in (self.tokens, pos, self.loss_mask, rows)))  # each [1, L]
        if self.mrope is None:
            return packed
        return packed._replace(position_ids=torch.cat([packed.position_ids, self.mrope[real].T])[:, None])

    def position_ids(self) -> torch.Tensor | None:
        """The padded rows' position ids where the model needs them given: [4, B, T] for a
        vision-language batch (the text position 0..T-1, then t, h, w); None for a text batch."""
        if self.mrope is None:
            return None
        B, T = self.tokens.shape
        text = torch.arange(T, device=self.tokens.device).expand(1, B, T)
        return torch.cat([text, self.mrope.permute(2, 0, 1)])

    def prompt_lengths(self) -> torch.Tensor:
        """[B] the tokens before each row's first loss token (0 for a row without one)."""
        return torch.where(self.loss_mask.any(1), self.loss_mask.int().argmax(1), 0)

    def prompt_groups(self, lens: torch.Tensor | None = None) -> list[list[int]] | None:
        """Rows grouped by identical prompt (the tokens before the first loss token, and the images),
        groups in order of first appearance; None if a row has no prompt or no loss token. `lens`:
        prompt_lengths(), if the caller has it."""
        lens = self.prompt_lengths() if lens is None else lens
        if not bool((lens > 0).all()):
            return None
        groups: dict[tuple, list[int]] = {}
        for b, n in enumerate(lens.tolist()):
            key = (tuple(self.tokens[b, :n].tolist()), self.images.key(b) if self.images is not None else None)
            groups.setdefault(key, []).append(b)
        return list(groups.values())

    def shared(self) -> Shared | None:
        """The shared-prompt layout (see Shared); None if a row has no prompt or no loss token, or
        holds images in its completion (those run with the prompts'). The loss tokens come out in the
        same order as the padded layout's (row-major), so per-token inputs built from `loss_mask` line
        up with either layout."""
        if self.images is not None and any(self.images.later):
            return None
        lens, dev = self.prompt_lengths(), self.tokens.device
        groups = self.prompt_groups(lens)
        if groups is None:
            return None
        first = torch.tensor([g[0] for g in groups], device=dev)
        group = torch.empty(len(self), dtype=torch.long, device=dev)
        for g, rows in enumerate(groups):
            group[rows] = g
        P, plen = int(lens.max()), lens[first]  # [G]
        clen = self.lengths - lens  # [B]
        C = int(clen.max())
        P_idx, C_idx = torch.arange(P, device=dev), torch.arange(C, device=dev)
        prompt_mask = P_idx[None] < plen[:, None]  # [G, P]
        prompts = torch.where(prompt_mask, self.tokens[first, :P], 0)  # P < T: every row has a loss token
        src = (lens[:, None] + C_idx[None]).clamp(max=self.tokens.shape[1] - 1)  # [B, C] positions in the row
        comp_mask = C_idx[None] < clen[:, None]  # [B, C]
        completions = torch.where(comp_mask, self.tokens.gather(1, src), 0)
        loss = self.loss_mask.gather(1, src) & comp_mask
        attn = torch.cat([prompt_mask[group], comp_mask], 1).long()
        mm = {}
        if self.mrope is not None:  # the prompts' positions, and the completions' from where each prompt ends
            mm = dict(
                prompt_mrope=self.mrope[first, :P],
                completion_mrope=self.mrope.gather(1, src[..., None].expand(-1, -1, 3)),
            )
        return Shared(prompts, plen, group, completions, attn, lens[:, None] + C_idx[None], loss, **mm)


def _with_images(pixels: list[Pixels | None] | None, lengths: np.ndarray, prompts: np.ndarray) -> dict:
    """Batch's mrope and images for rows that have `pixels`; {} if none has. A row takes its images'
    positions (its prompt's, or its whole row's) and every token after them counts on from `Pixels.next`
    (text, in all three rows); a row without images counts 0..len-1 in all three, as a text model does.
    `prompts`: each row's prompt length (a row whose positions run past it holds images there)."""
    if not pixels or all(px is None for px in pixels):
        return {}
    T = int(lengths.max())
    mrope = torch.arange(T).repeat(len(pixels), 3, 1)  # [B, 3, T]
    for b, px in enumerate(pixels):
        if px is not None:
            P = px.positions.shape[1]
            mrope[b, :, :P] = px.positions
            mrope[b, :, P:] = torch.arange(px.next, px.next + T - P)
    return dict(
        mrope=mrope.transpose(1, 2).contiguous(),
        images=RowImages(
            [px and px.values for px in pixels],
            [px and px.grid for px in pixels],
            [px is not None and px.positions.shape[1] > int(p) for px, p in zip(pixels, prompts)],
        ),
    )


def stack_routes(routes: list[torch.Tensor | None] | None, T: int) -> torch.Tensor | None:
    """Rows' routes [len_b, L, k] as one [B, T, L, k] int16 tensor, -1 where a row has none; None if
    no row has any (a dense model)."""
    shape = next((r.shape[1:] for r in routes or [] if r is not None), None)
    if shape is None:
        return None
    out = torch.full((len(routes), T, *shape), -1, dtype=torch.int16)
    for b, r in enumerate(routes):
        if r is not None:
            out[b, : r.shape[0]] = r[:T]
    return out


def micro_batches(lengths: torch.Tensor, max_tokens: int, packed: bool = False) -> list[torch.Tensor]:
    """Split rows into groups whose size fits `max_tokens`: rows x longest row when padded,
    the sum of the lengths when `packed`.

    Rows are sorted by length first so that padding inside a group is small. A single row
    longer than the budget still gets a group of its own.
    """
    order = torch.argsort(lengths, descending=True, stable=True)
    groups, current, longest, total = [], [], 0, 0
    for i in order.tolist():
        L = int(lengths[i])
        size = total + L if packed else max(longest, L) * (len(current) + 1)
        if current and size > max_tokens:
            groups.append(torch.tensor(current))
            current, longest, total = [], 0, 0
        current.append(i)
        longest, total = max(longest, L), total + L
    if current:
        groups.append(torch.tensor(current))
    return groups


def shared_micro_batches(batch: Batch, max_tokens: int) -> list[torch.Tensor]:
    """Micro-batches that keep a prompt's rows together, so the prompt is computed once for all of
    them: rows in group order while (prompts x longest prompt) + (rows x longest completion) fits
    `max_tokens`; a group that does not fit is cut, and the next micro-batch computes its prompt again."""
    lens = batch.prompt_lengths()
    groups = batch.prompt_groups(lens) or [[b] for b in range(len(batch))]
    plen, comp = lens.tolist(), (batch.lengths - lens).tolist()
    out, current, n_groups, P, C = [], [], 0, 0, 0
    for rows in groups:
        for k, b in enumerate(rows):
            g, p, c = n_groups + (k == 0), max(P, plen[b]), max(C, comp[b])
            if current and g * p + (len(current) + 1) * c > max_tokens:
                out.append(torch.tensor(current))
                current, g, p, c = [], 1, plen[b], comp[b]  # the group's prompt again
            current.append(b)
            n_groups, P, C = g, p, c
    if current:
        out.append(torch.tensor(current))
    return out


def per_token(forward, batch: Batch, groups: list[torch.Tensor | None], device):
    """Run `forward(micro_batch) -> [N]` (one value per masked token) over `groups` of rows and
    lay the results out like `batch.loss_mask`: [B, T] float32 on the CPU. A None group runs row 0
    and is dropped (it keeps a rank in step with the others' collectives under ZeRO-3). A forward
    that returns ([N], [N, d]) gives ([B, T], [B, T, d]), the second in its own dtype (hidden states)."""
    outs: list[torch.Tensor] = []
    for idx in groups:
        mb = batch.select(idx if idx is not None else torch.tensor([0]))
        vals = forward(mb.to(device))
        if idx is None:
            continue
        vals = vals if isinstance(vals, tuple) else (vals,)
        if not outs:
            outs = [torch.zeros(batch.tokens.shape + v.shape[1:], dtype=_kept(v)) for v in vals]
        for out, v in zip(outs, vals):
            rows = torch.zeros(mb.tokens.shape + v.shape[1:], dtype=out.dtype)
            rows[mb.loss_mask] = v.to(out.dtype).cpu()
            out[idx, : rows.shape[1]] = rows
    if not outs:
        return torch.zeros(batch.tokens.shape, dtype=torch.float32)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _kept(v: torch.Tensor) -> torch.dtype:
    return torch.float32 if v.dim() == 1 else v.dtype
