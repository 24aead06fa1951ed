"""Ulysses sequence parallelism for the trainer: one micro-batch's tokens split over a group of ranks.

`train.sequence_parallel_size` consecutive ranks form a group that trains on its ranks' rollouts
together (`gather_batch`). A micro-batch is laid end to end as one packed row (`Batch.packed()`),
padded to a multiple of the group's size, and each rank runs the model on its contiguous slice of
it (`shard`): the embeddings, MLPs, norms and rotary positions are per token, so only attention
needs the rest of the sequence. Around attention an all-to-all trades the sequence for the heads
(each rank gets the whole sequence for heads/size of the heads), the model's own attention runs
on that (sdpa causally per packed sample, eager with the samples' block-causal mask,
flash-attention with the full position ids, its varlen path), and a second all-to-all trades them
back. This is DeepSpeed's `deepspeed.sequence.layer.DistributedAttention` and verl's
`verl/utils/ulysses.py`, hooked in through transformers' AttentionInterface (an implementation
named `ulysses_<inner>` that wraps the model's own) rather than a patch of transformers'
flash-attention function. Departures: KV heads that the group's size does not divide are repeated
to the query heads before the exchange (DeepSpeed does the same; verl repeats to a multiple of the
size); the group's size must divide the query heads (resolve checks it before any engine starts).

Each rank scores the loss tokens its slice predicts (position p predicts token p + 1: the target
of a slice's last position is the next slice's first token, taken from the full row), so the
per-token loss inputs are sliced alike (`Shard.part`) and the loss, a token sum over a global
normaliser, sums over the group to the whole micro-batch's: gradients need no rescaling beyond the
data-parallel average DeepSpeed takes over all ranks (trainer.py).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from hybridrl.data.batch import Batch, per_token


class Group(NamedTuple):
    """This rank's sequence-parallel group: `size` consecutive ranks, this one `rank` of them."""

    pg: object  # the torch.distributed process group (None for a group of one)
    rank: int
    size: int
    index: int  # which group in the world


def new_groups(size: int) -> Group:
    """Every rank calls this, in the same order (new_group is collective over the world): groups of
    `size` consecutive ranks."""
    if size == 1:
        return Group(None, 0, 1, dist.get_rank() if dist.is_initialized() else 0)
    world, me = dist.get_world_size(), dist.get_rank()
    mine = None
    for g in range(world // size):
        pg = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == me // size:
            mine = Group(pg, me % size, size, g)
    return mine


# --- the group's batch ----------------------------------------------------------------------------
def gather_batch(batch: Batch, group: Group) -> tuple[Batch, int]:
    """The group's rollouts as one batch (its ranks' rows in rank order, right-padded to the longest),
    the same on every rank of the group, and where this rank's rows start in it."""
    if group.size == 1:
        return batch, 0
    parts: list = [None] * group.size
    dist.all_gather_object(parts, batch.to("cpu"), group=group.pg)
    T = max(p.tokens.shape[1] for p in parts)

    def cat(name):
        xs = [getattr(p, name) for p in parts]
        if xs[0] is None:
            return None
        return torch.cat([x if x.dim() == 1 else torch.nn.functional.pad(x, (0, T - x.shape[1])) for x in xs])

    start = sum(len(p) for p in parts[: group.rank])
    return replace(batch, **{f.name: cat(f.name) for f in fields(Batch)}), start


def rows_of(per_token: torch.Tensor, start: int, batch: Batch) -> torch.Tensor:
    """This rank's rows of a [B_group, T_group] per-token tensor, cut to its own batch's shape."""
    return per_token[start : start + len(batch), : batch.tokens.shape[1]]


# --- one micro-batch's slices ------------------------------------------------------------------------
@dataclass
class Shard:
    """One rank's slice of a packed micro-batch, and what attention needs of the whole row."""

    tokens: torch.Tensor  # [1, S] long, this rank's slice of the packed (and padded) row
    position_ids: torch.Tensor  # [1, S] long, their positions within their samples
    targets: torch.Tensor  # [1, S] long, the token each position predicts (the next one in the row)
    sel: torch.Tensor  # [1, S] bool, positions whose next token is a loss token
    segments: torch.Tensor  # [L] long, the sample each position of the whole row belongs to (padding: its own)
    full_position_ids: torch.Tensor  # [1, L] long, the whole row's positions
    part: slice  # this rank's loss tokens among the micro-batch's, in loss_mask's row-major order


def shard(mb: Batch, rank: int, size: int) -> Shard:
    """mb's samples end to end (Batch.packed: row-major, so the loss tokens keep the padded layout's
    order), padded to size x S tokens, and rank's S of them."""
    p = mb.to("cpu").packed()
    L = p.tokens.shape[1]
    S = math.ceil(L / size)
    pad = S * size - L
    tokens = torch.nn.functional.pad(p.tokens[0], (0, pad))  # [L'] padding: token 0, a sample of its own
    positions = torch.cat([p.position_ids[0], torch.arange(pad)])
    segments = torch.cat([p.seq_ids[0], torch.full((pad,), len(mb), dtype=torch.long)])
    targets = torch.cat([tokens[1:], tokens.new_zeros(1)])  # position t predicts token t + 1
    # a sample's first token is never a loss token (packed() checks), so no position predicts across samples
    sel = torch.cat([p.loss_mask[0, 1:], torch.zeros(pad + 1, dtype=torch.bool)])
    a, b = rank * S, (rank + 1) * S
    n0 = int(sel[:a].sum())
    part = slice(n0, n0 + int(sel[a:b].sum()))
    dev = mb.tokens.device
    return Shard(
        tokens[a:b][None].to(dev),
        positions[a:b][None].to(dev),
        targets[a:b][None].to(dev),
        sel[a:b][None].to(dev),
        segments.to(dev),
        positions[None].to(dev),
        part,
    )


def module_inputs(mb: Batch, group: Group) -> tuple[Shard, tuple, dict]:
    """This rank's slice of mb (`shard`) and TokenLogprobs' (tokens, attention_mask, loss_mask) and
    keyword inputs for it. The trainer and the reference run their slices alike."""
    s = shard(mb, group.rank, group.size)
    return (
        s,
        (s.tokens, None, None),
        dict(
            position_ids=s.position_ids,
            shard=dict(targets=s.targets, sel=s.sel, segments=s.segments, full_position_ids=s.full_position_ids),
        ),
    )


def group_logprobs(forward, batch: Batch, plan, group: Group, device) -> torch.Tensor:
    """[B, T] per-token values of this rank's `batch`, scored by the group together: its ranks' rows
    gathered, cut into `plan(group_batch)`'s micro-batches, `forward(mb) -> [n]` run on this rank's slice
    of each (the group's slices gathered in order), and this rank's rows taken back."""
    group_batch, start = gather_batch(batch, group)
    out = per_token(lambda mb: gather_tokens(forward(mb), group), group_batch, plan(group_batch), device)
    return rows_of(out, start, batch)


def gather_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The group's per-token values of one micro-batch in order ([N] from each rank's [n_r])."""
    if group.size == 1:
        return x
    n = torch.tensor([len(x)], device=x.device)
    ns = [torch.zeros_like(n) for _ in range(group.size)]
    dist.all_gather(ns, n, group=group.pg)
    most = int(max(int(k) for k in ns))
    padded = torch.nn.functional.pad(x, (0, most - len(x)))
    out = [torch.empty_like(padded) for _ in range(group.size)]
    dist.all_gather(out, padded, group=group.pg)
    return torch.cat([o[: int(k)] for o, k in zip(out, ns)])


def merge_metrics(group: Group, sums: dict, gap: tuple, *per_token: list) -> tuple:
    """Trainer.step's metric sums, log-prob gap (sum, count, max) and per-token lists (of tensors)
    over the group: each rank scored a slice of the tokens, a rank may have scored none."""
    parts: list = [None] * group.size
    mine = (sums, gap, [torch.cat(x).cpu() if len(x) else torch.zeros(0) for x in per_token])
    dist.all_gather_object(parts, mine, group=group.pg)
    merged: dict = {}
    for s, _, _ in parts:
        for k, v in s.items():
            merged[k] = merged.get(k, 0.0) + v
    gap = (sum(p[1][0] for p in parts), sum(p[1][1] for p in parts), max(p[1][2] for p in parts))
    lists = []
    for i in range(len(per_token)):
        x = torch.cat([p[2][i] for p in parts])
        lists.append([x] if len(x) else [])
    return merged, gap, *lists


# --- attention ---------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """x [size, ...]: chunk j goes to rank j; out [size, ...]: chunk j came from rank j. Its adjoint
    is the same exchange."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        x = x.contiguous()  # first: empty_like keeps a strided input's strides, all_to_all writes it flat
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=pg)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g, group=ctx.pg)
        return out, None


def seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[1, H, S, D] (this rank's slice of the sequence, every head) -> [1, H/n, n S, D] (the whole
    sequence, this rank's heads)."""
    _, H, S, D = x.shape
    n = group.size
    y = _AllToAll.apply(x.reshape(n, H // n, S, D), group.pg)  # [n (the slice's rank), H/n, S, D]
    return y.transpose(0, 1).reshape(1, H // n, n * S, D)


def heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """seq_to_heads' inverse: [1, H/n, n S, D] -> [1, H, S, D]."""
    _, h, L, D = x.shape
    n = group.size
    y = x.reshape(h, n, L // n, D).transpose(0, 1)  # [n (the slice's rank), H/n, S, D]
    return _AllToAll.apply(y, group.pg).reshape(1, n * h, L // n, D)


@dataclass
class Active:
    """What the attention of the forward under way needs: the group and the whole row's layout."""

    group: Group
    segments: torch.Tensor  # [L]
    position_ids: torch.Tensor  # [1, L]

    @functools.cached_property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each packed sample in the whole row (padding is a sample of its own), read
        once per forward: every layer's attention uses them."""
        counts = torch.unique_consecutive(self.segments, return_counts=True)[1].tolist()
        ends = list(itertools.accumulate(counts))
        return list(zip([0] + ends[:-1], ends))


# Set by policy.TokenLogprobs at the start of every forward (None without sequence parallelism), and
# left in place until the next one: gradient checkpointing recomputes the layers in backward.
ACTIVE: Active | None = None
PREFIX = "ulysses_"


class _Seen:
    """What `__getattr__` does not find here comes from the wrapped object: the attention module as
    the inner attention sees it (its KV heads repeated: `num_key_value_groups`; its config naming
    the inner implementation: `config`), or that config."""

    def __init__(self, inner, **seen):
        self._inner = inner
        self.__dict__.update(seen)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _as_seen_by(module, implementation: str):
    """`module` with a config whose `_attn_implementation` is the inner `implementation`:
    transformers' flash-attention wrapper picks its kernel by that name, and the model's own is
    `ulysses_<inner>`, which no kernel has ("Could not find the currently requested flash
    attention implementation")."""
    return _Seen(module, config=_Seen(module.config, _attn_implementation=implementation))


def _inner(name: str, module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward  # eager: the model's own


def _attention(inner_name: str):
    def attention(module, query, key, value, attention_mask, **kw):
        """transformers' attention signature: query [1, H, S, D], key/value [1, KVH, S, D] ->
        ([1, S, H, D], None)."""
        inner = _inner(inner_name, module)
        if inner_name.startswith("flash"):
            module = _as_seen_by(module, inner_name)
        act = ACTIVE
        if act is None:  # not a sequence-parallel forward (the LoRA reference on the trainer's model)
            return inner(module, query, key, value, attention_mask, **kw)
        g = act.group
        if key.shape[1] % g.size:  # too few KV heads to share out: repeat them to the query heads
            rep = query.shape[1] // key.shape[1]
            key, value = (torch.repeat_interleave(x, rep, dim=1) for x in (key, value))
            module = _Seen(module, num_key_value_groups=1)
        q, k, v = (seq_to_heads(x, g) for x in (query, key, value))  # [1, H/n, L, D]
        kw.pop("position_ids", None)
        if inner_name.startswith("flash"):  # varlen over the packed samples, from their positions
            out, _ = inner(module, q, k, v, None, position_ids=act.position_ids, **kw)
        elif inner_name == "sdpa":
            # one causal call per packed sample: a block-causal [L, L] mask would be built per layer
            # and kept by sdpa for the backward in float (2 GiB a layer at 32k tokens), where the
            # plan counts activations linear in the tokens; causal sdpa builds no mask
            out = torch.cat(
                [inner(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, **kw)[0] for a, b in act.bounds], dim=1
            )
        else:  # eager: the [L, L] scores are its own; it adds the block-causal mask to them
            L = act.segments.shape[0]
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril_()
            keep = (causal & (act.segments[:, None] == act.segments[None]))[None, None]  # [1, 1, L, L]
            mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, torch.finfo(q.dtype).min)
            out, _ = inner(module, q, k, v, mask, **kw)
        out = heads_to_seq(out.transpose(1, 2), g)  # [1, H, S, D]
        return out.transpose(1, 2).contiguous(), None

    return attention


def install(hf) -> str:
    """Switch `hf` to the sequence-parallel wrapper of its attention implementation (registered with
    transformers once per name, with the inner implementation's mask builder, so its forwards outside
    sequence parallelism are unchanged); returns the name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    inner = hf.config._attn_implementation
    name = PREFIX + inner
    AttentionInterface.register(name, _attention(inner))
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    AttentionMaskInterface.register(name, masks.get(inner, masks["eager"]))
    hf.set_attn_implementation(name)
    return name
