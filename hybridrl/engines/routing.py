"""Routing replay (R3) on the trainer's side: a mixture-of-experts model's forward routes each token
to the experts vLLM routed it to while sampling, and the router's health as metrics.

Without it the trainer routes every token itself, and a token whose router scores sit near a tie
can go to other experts than in vLLM (kernels differ in the last bits): its log-prob then comes
from another sub-network than the one that sampled it, and on large MoE models that mismatch grows
until runs collapse (verl #3762; "rollout routing replay", arXiv 2510.11370). With it (`replay`),
the top-k *indices* are vLLM's; the gate *weights* are still the trainer's softmax over its own
router logits at those indices, so the router keeps its gradient.

The seam is a forward hook on each router module (transformers' `...TopKRouter`, which returns
(logits, top-k weights, top-k indices)): nothing of transformers is copied or monkey-patched, and a
router the hook does not know is refused before any engine starts (`supported`).

Routes travel as int16 `[T, L, k]` per sample (`Batch.routes`: [B, T, L, k]), position t holding the
experts of token t at decoder layer l; -1 = not recorded (the sample's last token, which vLLM never
fed forward, or a dense layer): the trainer routes that token itself.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridrl.core import families

# routers whose output is (logits, weights, indices) with weights = softmax(logits) at the indices,
# renormalised over the top-k when `norm_topk_prob`: what `_hook` recomputes at vLLM's indices
SUPPORTED_ROUTERS = tuple(f.router for f in families.FAMILIES.values())
# routers that always renormalise the top-k weights and keep them in float32 (Mixtral's); the others do
# as their norm_topk_prob says, in the logits' dtype
_RENORMALISE = {f.router for f in families.FAMILIES.values() if f.renormalise}
_LAYER = re.compile(r"layers\.(\d+)\.")


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its MoE router (any `...TopKRouter`), for a transformers model."""
    out = {}
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("TopKRouter"):
            m = _LAYER.search(name + ".")
            if m:
                out[int(m.group(1))] = mod
    return out


def is_moe(model_config) -> bool:
    """A mixture-of-experts config (core/families.py: more than one routed expert, by any family's key)."""
    return families.is_moe(model_config)


def wanted(cfg, model_config) -> tuple[bool, bool]:
    """(record vLLM's routes, replay them) for this run: recorded for every MoE model (the mismatch
    and load metrics need them), replayed unless algo.routing_replay=off. `auto` replays: on the tiny
    MoE the capture adds ~0-6% to generation and nothing measurable to the trainer's forward and
    backward (bench.routing_replay, docs/status.md). A dense model records and replays nothing
    (algo.routing_replay=on then has nothing to do: the trainer says so)."""
    moe = is_moe(getattr(model_config, "get_text_config", lambda: model_config)())
    return moe, moe and cfg.algo.routing_replay != "off"


def supported(model: nn.Module) -> str | None:
    """None if every router of `model` can be replayed, else why not (one line)."""
    found = routers(model)
    if not found:
        return f"{type(model).__name__} has no MoE router to replay"
    bad = sorted({type(r).__name__ for r in found.values()} - set(SUPPORTED_ROUTERS))
    return f"routers {', '.join(bad)} are not supported (only {', '.join(SUPPORTED_ROUTERS)})" if bad else None


@dataclass
class Segment:
    """One base-model forward's tokens, flattened in the forward's order (hidden_states.view(-1, d))."""

    routes: torch.Tensor  # [N, L, k] long, vLLM's experts; -1 where not recorded
    valid: torch.Tensor  # [N] bool, real tokens (not padding): the ones the metrics count


@dataclass
class Replay:
    """What the hooks read and write during one micro-batch: the segments (one per base-model forward
    of the micro-batch, in call order), whether to substitute vLLM's experts, and per layer what the
    trainer's own router chose (for the mismatch metric) and the experts used (for the load)."""

    segments: list[Segment]
    substitute: bool
    calls: dict[int, int] = field(default_factory=dict)  # layer -> forwards seen
    # layer -> (trainer's, vLLM's) [n, k]
    own: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E] tokens routed to each expert


_ACTIVE: list[Replay] = []  # the micro-batch being run (a stack, so a nested forward cannot leak)


def _hook(layer: int):
    def hook(mod, args, out):
        if not _ACTIVE:
            return None
        st = _ACTIVE[-1]
        call = st.calls.get(layer, 0)
        st.calls[layer] = call + 1
        seg = st.segments[call % len(st.segments)]  # a recomputed forward (checkpointing) starts over
        logits, weights, idx = out  # [N, E], [N, k], [N, k]
        if seg.routes.shape[0] != idx.shape[0] or layer >= seg.routes.shape[1]:
            raise RuntimeError(
                f"routing replay: layer {layer} saw {idx.shape[0]} tokens, the routes hold {tuple(seg.routes.shape)}"
            )
        theirs = seg.routes[:, layer].to(idx.device)  # [N, k]
        known = (theirs >= 0).all(-1) & seg.valid.to(idx.device)  # [N]
        first = call < len(st.segments)  # not a recomputation (gradient checkpointing's backward)
        if first:
            st.own.setdefault(layer, []).append((idx[known].detach(), theirs[known]))
        if st.substitute and bool(known.any()):
            idx = torch.where(known[:, None], theirs.to(idx.dtype), idx)  # [N, k]
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [N, E], as the router computes them
            weights = probs.gather(1, idx)  # [N, k]: the gradient reaches the router's logits
            always = type(mod).__name__ in _RENORMALISE
            if always or getattr(mod, "norm_topk_prob", False):
                weights = weights / weights.sum(-1, keepdim=True)
            weights = weights if always else weights.to(logits.dtype)
        if first:
            used = idx[seg.valid.to(idx.device)].detach().flatten()
            counts = torch.bincount(used, minlength=logits.shape[-1]).cpu()
            st.load[layer] = st.load.get(layer, 0) + counts
        return logits, weights, idx

    return hook


class Router:
    """The hooks on one model's routers, installed once (`attach`); `run(...)` scopes a micro-batch."""

    def __init__(self, model: nn.Module):
        self.layers = routers(model)
        self.handles = [r.register_forward_hook(_hook(i)) for i, r in self.layers.items()]
        self.mismatch = [0, 0]  # tokens (any layer differs), tokens compared
        self.pairs = [0, 0]  # (token, layer) pairs that differ, compared
        self.load: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def run(self, segments: list[Segment], substitute: bool):
        st = Replay(segments, substitute)
        _ACTIVE.append(st)
        try:
            yield st
        finally:
            _ACTIVE.pop()
            self._account(st)

    def _account(self, st: Replay) -> None:
        for layer, c in st.load.items():
            self.load[layer] = self.load.get(layer, 0) + c
        if st.own:  # every layer compared the same tokens (those with routes), in the same order
            ours = torch.stack([torch.cat([o for o, _ in v]) for v in st.own.values()], 1)  # [n, L', k]
            theirs = torch.stack([torch.cat([t for _, t in v]) for v in st.own.values()], 1)
            tok, pair = mismatch_counts(ours, theirs)
            self.mismatch[0] += tok
            self.mismatch[1] += ours.shape[0]
            self.pairs[0] += pair
            self.pairs[1] += ours.shape[0] * ours.shape[1]

    def metrics(self) -> dict[str, float]:
        """Since the last call: routing/mismatch (share of the tokens with vLLM's routes whose top-k
        differs from the trainer's own router at any layer), routing/mismatch_layer (per token and
        layer), router/load_cv and router/load_max_mean (the experts' load, mean over layers)."""
        out = {}
        if self.mismatch[1]:
            out["routing/mismatch"] = self.mismatch[0] / self.mismatch[1]
            out["routing/mismatch_layer"] = self.pairs[0] / max(self.pairs[1], 1)
        if self.load:
            out.update(load_balance(torch.stack(list(self.load.values()))))
        self.mismatch, self.pairs, self.load = [0, 0], [0, 0], {}
        return out


# --- pure functions -------------------------------------------------------------------------------
def mismatch_counts(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[int, int]:
    """(tokens whose top-k set differs at any layer, (token, layer) pairs that differ) for top-k
    indices `ours`, `theirs` of shape [N, L, k]. The order within a top-k does not matter (a set of
    experts; vLLM and transformers may list ties differently)."""
    differ = (ours.sort(-1).values != theirs.sort(-1).values).any(-1)  # [N, L]
    return int(differ.any(-1).sum()), int(differ.sum())


def routing_mismatch(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Share of tokens whose top-k experts differ between two routings [N, L, k] at any layer."""
    return mismatch_counts(ours, theirs)[0] / max(ours.shape[0], 1)


def load_balance(counts: torch.Tensor) -> dict[str, float]:
    """The experts' load from token counts [L, E] (tokens routed to each expert per layer), mean over
    layers: router/load_cv (coefficient of variation, std/mean: 0 = perfectly even) and
    router/load_max_mean (the busiest expert's load over the mean: 1 = even, E = one expert takes all)."""
    c = counts.double()
    mean = c.mean(-1)  # [L]
    ok = mean > 0
    if not bool(ok.any()):
        return {}
    cv = c.std(-1, unbiased=False)[ok] / mean[ok]
    return {"router/load_cv": float(cv.mean()), "router/load_max_mean": float((c.max(-1).values[ok] / mean[ok]).mean())}


# --- layouts: the routes of a micro-batch in the order its forward sees the tokens -------------------
def padded_segments(routes: torch.Tensor, attention: torch.Tensor) -> list[Segment]:
    """Right-padded rows [B, T]: one forward over B * T tokens."""
    return [Segment(routes.flatten(0, 1).long(), attention.flatten())]


def packed_segments(routes: torch.Tensor, attention: torch.Tensor) -> list[Segment]:
    """Rows end to end (Batch.packed: the real tokens in row-major order): one forward."""
    r = routes[attention.bool()].long()  # [L, layers, k]
    return [Segment(r, torch.ones(r.shape[0], dtype=torch.bool))]


def shared_segments(routes: torch.Tensor, batch) -> list[Segment]:
    """The shared-prompt layout (Batch.shared): the distinct prompts' forward [G, P], then the rows'
    completions [B, C]; the same rows and positions Batch.shared() takes."""
    lens = batch.prompt_lengths()  # [B]
    groups = batch.prompt_groups(lens)
    first = torch.tensor([g[0] for g in groups])
    P, C = int(lens.max()), int((batch.lengths - lens).max())
    plen = lens[first]
    p_mask = torch.arange(P)[None] < plen[:, None]  # [G, P]
    prompts = torch.where(p_mask[..., None, None], routes[first, :P].long(), -1)
    src = (lens[:, None] + torch.arange(C)[None]).clamp(max=routes.shape[1] - 1)  # [B, C]
    c_mask = torch.arange(C)[None] < (batch.lengths - lens)[:, None]
    comp = routes.long()[torch.arange(len(lens))[:, None], src]  # [B, C, L, k]
    comp = torch.where(c_mask[..., None, None], comp, -1)
    return [Segment(prompts.flatten(0, 1), p_mask.flatten()), Segment(comp.flatten(0, 1), c_mask.flatten())]
