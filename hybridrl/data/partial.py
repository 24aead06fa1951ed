"""Partial rollouts inside the colocated step: the buffer of groups in flight, as pure bookkeeping.

With `rollout.partial=on` a step issues more groups than it trains on (`rollout.partial_oversample`
x its share of train.prompts_per_step, the groups carried from the last step included), stops vLLM
as soon as enough groups are complete (every one of their n samples finished: GRPO's advantages
need the whole group), and keeps the rest: each unfinished sample keeps its tokens, vLLM's
log-probs of them (the behaviour policy's) and the policy version that sampled each token. The
next step re-feeds prompt + tokens so far to vLLM (its prefix cache computes a group's prompt
once) with the token budget that is left, and stamps the new tokens with its own version.

Staleness: a token sampled by the policy of version v and trained by version V is V - v updates
old. `rollout.partial_max_age` caps it: a group whose oldest token has reached the cap is not
aborted (the step waits for it), so no token trains older than the cap; a group found over the cap
(a resume with a lower cap) is dropped and its prompt generated again from scratch. Stale tokens
are trained with the importance correction against the stored behaviour log-probs (algo.is_correction:
TIS or masked IS, w = pi_old / pi_behaviour; docs/losses.md), the same as vLLM/trainer mismatch.

The design is slime's "active partial rollouts" (over-sample, abort, put the partial samples back
in the buffer, continue them first) inside one process: no rollout workers, no weight transport.
Departures: the staleness cap waits for a capped group instead of discarding its tokens (verl's
partial rollout has no cap; slime's is a mask), and groups are kept whole.

collect.py drives it (`Collector._round_partial`); the step's metrics come from `metrics`, the
IS-weight spread from `is_metrics`; the checkpoint holds `state()` (checkpoint.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridrl.data.batch import Sample


@dataclass
class Group:
    """One prompt's n samples in flight. samples[j] is None until sample j has produced a token."""

    index: int  # the prompt's row in the training prompts
    samples: list[Sample | None]
    done: list[bool]  # sample j reached EOS/stop or its length limit
    born: int = 0  # the policy version that started the group (its first tokens')

    @property
    def complete(self) -> bool:
        return all(self.done)


def version_of(step: int) -> int:
    """The policy version that samples in `step` (1-based): the optimizer updates before it."""
    return step - 1


def fresh(index: int, n: int, version: int) -> Group:
    return Group(index, [None] * n, [False] * n, version)


def oldest(group: Group) -> int | None:
    """The version of the group's oldest token; None if it has none."""
    vs = [min(s.versions) for s in group.samples if s is not None and s.versions]
    return min(vs) if vs else None


def age(group: Group, version: int) -> int:
    """How many updates old the group's oldest token is when `version` trains on it (0: none stale)."""
    o = oldest(group)
    return 0 if o is None else version - o


def triage(buffer: list[Group], version: int, max_age: int) -> tuple[list[Group], list[Group]]:
    """(groups to continue at `version`, groups over the cap: to drop and generate again)."""
    keep = [g for g in buffer if age(g, version) <= max_age]
    return keep, [g for g in buffer if age(g, version) > max_age]


def must_finish(group: Group, version: int, max_age: int) -> bool:
    """A group that could not be carried once more: at `version + 1` its oldest token would be over
    the cap. The step does not stop before it is complete."""
    return age(group, version + 1) > max_age


def to_issue(target: int, oversample: float, carried: int) -> int:
    """Fresh groups to issue: `oversample` x `target` in flight, the carried ones counted."""
    return max(0, math.ceil(target * oversample - 1e-9) - carried)


def enough(complete: int, target: int, waiting: int) -> bool:
    """Stop generating: `target` groups are complete and no group at the cap is still running."""
    return complete >= target and waiting == 0


def continuations(
    buffer: list[Group], prompt_ids: list[list[int]], max_new_tokens: int, first: int = 0
) -> list[tuple[int, int, list[int], int]]:
    """Rollout.generate_partial's `carried`: (prompt index first + g, sample j, prompt + tokens so far,
    tokens left) for every unfinished sample of buffer[g] that has tokens; a sample with none yet
    (cut before its first token) starts over from its prompt alone."""
    out = []
    for g, (group, ids) in enumerate(zip(buffer, prompt_ids)):
        for j, (s, done) in enumerate(zip(group.samples, group.done)):
            if done:
                continue
            prefix = s.token_ids if s is not None else []
            out.append((first + g, j, ids + prefix, max_new_tokens - len(prefix)))
    return out


def put(group: Group, j: int, new: Sample, version: int, done: bool) -> None:
    """Record what vLLM returned for sample j this step (`new`: its tokens after what it had),
    stamping the new tokens with `version`; the sample's earlier tokens keep theirs."""
    new.versions = [version] * len(new.token_ids)
    old = group.samples[j]
    if old is not None:
        new.token_ids = old.token_ids + new.token_ids
        new.logprobs = old.logprobs + new.logprobs
        new.versions = old.versions + new.versions
    new.sample_idx = j
    group.samples[j] = new
    group.done[j] = done


def metrics(trained: list[Sample], version: int, max_age: int) -> dict[str, float]:
    """The trained samples' staleness: the share of stale tokens (sampled by an older policy), the
    share at each age 0..max_age (partial/age_k), and the share of samples that carry any."""
    ages = [version - v for s in trained for v in (s.versions or [])]
    n = max(len(ages), 1)
    hist = (
        torch.bincount(torch.tensor(ages, dtype=torch.long), minlength=max_age + 1)
        if ages
        else torch.zeros(max_age + 1, dtype=torch.long)
    )
    out = {
        "partial/stale_token_frac": float(sum(a > 0 for a in ages)) / n,
        "partial/stale_sample_frac": sum(any(version - v > 0 for v in (s.versions or [])) for s in trained)
        / max(len(trained), 1),
    }
    out.update({f"partial/age_{k}": float(hist[k]) / n for k in range(len(hist))})
    return out


def stale_mask(trained: list[Sample], version: int, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool like `loss_mask`: the loss tokens an older policy sampled (single-turn samples:
    their loss tokens are their completion tokens, in order)."""
    out = torch.zeros_like(loss_mask)
    out[loss_mask] = torch.tensor(
        [v < version for s in trained for v in (s.versions or [version] * len(s.token_ids))], dtype=torch.bool
    )
    return out


def is_metrics(
    logp_old: torch.Tensor | None, logp_behaviour: torch.Tensor, loss_mask: torch.Tensor, stale: torch.Tensor
) -> dict[str, float]:
    """The token importance weights pi_old / pi_behaviour (before truncation or masking) on stale and
    on fresh tokens: mean, std, min, max. A stale token's weight carries its policy's drift since it
    was sampled; a fresh token's only the engines' mismatch (~1)."""
    if logp_old is None:  # one update per step: the trainer reports them from that update (weight_metrics)
        return {}
    w = token_weights(logp_old, logp_behaviour)  # [B, T]
    return weight_metrics(w[loss_mask], stale[loss_mask])


def token_weights(logp_old: torch.Tensor, logp_behaviour: torch.Tensor) -> torch.Tensor:
    """pi_old / pi_behaviour per token, before truncation or masking (the exponent clamped to +-20)."""
    return (logp_old - logp_behaviour).clamp(-20, 20).exp()


def weight_metrics(w: torch.Tensor, stale: torch.Tensor) -> dict[str, float]:
    """is_metrics' figures from per-token weights `w` [N] and their stale flags [N]."""
    out = {}
    for name, sel in (("stale", stale), ("fresh", ~stale)):
        x = w[sel]
        if x.numel():
            out.update(
                {
                    f"partial/is_{name}_mean": float(x.mean()),
                    f"partial/is_{name}_std": float(x.std(unbiased=False)),
                    f"partial/is_{name}_min": float(x.min()),
                    f"partial/is_{name}_max": float(x.max()),
                }
            )
    return out


@dataclass
class Buffer:
    """This rank's groups in flight between steps, and what the last step did with them."""

    groups: list[Group] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)

    def state(self) -> list[dict]:
        """Plain lists and numbers, for the rank's checkpoint file."""
        return [
            {
                "index": g.index,
                "born": g.born,
                "done": list(g.done),
                "samples": [
                    None
                    if s is None
                    else {
                        "token_ids": list(s.token_ids),
                        "logprobs": list(s.logprobs),
                        "versions": list(s.versions or []),
                        "finished": s.finished,
                    }
                    for s in g.samples
                ],
            }
            for g in self.groups
        ]

    def load(self, state: list[dict] | None) -> None:
        def sample(j: int, s: dict | None) -> Sample | None:
            return (
                None
                if s is None
                else Sample(0, s["token_ids"], s["logprobs"], s["finished"], j, versions=s["versions"])
            )

        self.groups = [
            Group(d["index"], [sample(j, s) for j, s in enumerate(d["samples"])], list(d["done"]), d["born"])
            for d in state or []
        ]
