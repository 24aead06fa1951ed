"""Canaries: cheap per-step checks that a run is broken, not just slow, and the distributions
behind the mean metrics.

`Canaries.check(step, metrics)` is fed each step's metrics dict (what `loop.train` logs) and
returns the warnings that step raised. A warning fires when its condition starts to hold and
stays quiet while it keeps holding, so a run stuck in one state prints one line, not one per
step; it re-arms once the condition clears (the slow-step canary only after a cooldown).
`RunLog.step` calls it on rank 0 and writes each warning to the console and to metrics.jsonl as
`{"step", "warning"}`.

The thresholds follow the seeds' tuning guide: more than 30% of tokens clipped means the
sampling policy has drifted from the trained one (stale sync or a kernel mismatch); a 20% step
time creep is the cheapest early signal of KV-cache fragmentation or a slow verifier; a jump in
the trainer-vs-vLLM log-prob gap after a hand-off is a bug, not noise. The step-time canary waits
for a *sustained* creep (the recent median above the baseline for two recent-windows in a row)
and ignores steps under a minimum absolute time: on a shared machine a step as short as the demo's
wobbles by about the slow factor for a few steps at a time, and a warning for that would teach
users to ignore warnings;
more than half of a step's completions cut at `rollout.max_new_tokens` means the length limit,
not the policy, shapes the rewards.

`distribution_metrics(...)` turns per-sample lists into flat `name/p10`, `/p50`, `/p90` floats.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Iterable

QUANTILES = (0.1, 0.5, 0.9)


def distribution_metrics(quantiles: Iterable[float] = QUANTILES, **series) -> dict[str, float]:
    """`distribution_metrics(response_len=[3, 4, 4], reward=R)` ->
    {"response_len/p10": ..., "response_len/p50": ..., ..., "reward/p90": ...}.

    Each series is a list, a numpy array or a tensor of any shape (flattened); an empty one
    is skipped, so a rank with no samples logs nothing rather than NaN. Quantiles use linear
    interpolation (numpy's default), so p50 of [1, 2] is 1.5."""
    import numpy as np

    out: dict[str, float] = {}
    for name, values in series.items():
        if hasattr(values, "detach"):  # a torch tensor, possibly on the GPU
            values = values.detach().float().cpu().numpy()
        arr = np.asarray(values, dtype=np.float64).ravel()
        if arr.size == 0:
            continue
        for q in quantiles:
            out[f"{name}/p{round(q * 100)}"] = float(np.quantile(arr, q))
    return out


def step_time(metrics: dict) -> float:
    """Wall seconds of one step: the sum of its `time/<phase>` entries."""
    return sum(v for k, v in metrics.items() if k.startswith("time/"))


@dataclass
class Thresholds:
    clip_frac: float = 0.3  # clip_frac_low + clip_frac_high
    slow_factor: float = 1.2  # recent step time vs the median of the `window` steps before
    # "recent step time" is the median of the last `recent` steps: one slow step on a shared machine
    # is jitter, a slowdown that lasts (a leak, a growing cache, a lost kernel) moves this median
    recent: int = 10
    # ... and it must stay above slow_factor x the baseline for this many steps in a row (two
    # recent-windows): a machine-load wobble moves the median for a few steps, a regression stays
    sustain: int = 20
    # below this recent median (seconds per step) nothing is called slow: steps as short as the
    # demo's move by more than slow_factor when a neighbour's job runs, and a regression worth a
    # warning costs more
    min_step_s: float = 0.25
    gap_factor: float = 10.0  # logp_gap_mean vs the median of the last `window` steps
    # fp32 gaps are ~1e-7 and jump 10x from rounding alone; below this the gap is noise
    gap_floor: float = 1e-3
    # baseline of the step-time canary (the steps before the recent ones): long enough that the
    # slow steps of a sustained slowdown are still a minority of it when the canary fires
    window: int = 50
    gap_window: int = 20  # baseline of the log-prob gap canary
    min_history: int = 5  # a median of fewer steps (compile, warm caches) is not a baseline
    # after a slow-step warning, stay quiet this many steps: on a shared or noisy machine single
    # slow steps come and go, and a warning every few steps would drown the others
    slow_cooldown: int = 50
    truncated_frac: float = 0.5  # completions cut at rollout.max_new_tokens (no EOS / stop string)


class Canaries:
    """Stateful: keeps the recent step times and log-prob gaps, and which warnings are active."""

    def __init__(self, thresholds: Thresholds | None = None):
        self.t = thresholds or Thresholds()
        self.times: deque[float] = deque(maxlen=self.t.window + self.t.recent)
        self.gaps: deque[float] = deque(maxlen=self.t.gap_window)
        self.slow_streak = 0  # consecutive steps whose recent median was slow (see _slow)
        self.active: set[str] = set()
        self.fired_at: dict[str, int] = {}
        self.fired: dict[str, int] = {}  # how often each warning fired (the run's summary counts them)

    def check(self, step: int, m: dict) -> list[str]:
        """The warnings that start at this step (each as one line of text)."""
        conditions = {name: fn(self, step, m) for name, fn in CHECKS.items()}
        # the baselines take this step after the comparison, so a spike is judged against the
        # steps before it; a slow or gapped step still enters them (a lasting shift becomes the
        # new normal after ~window/2 steps, and the canary re-arms)
        if "time/generate" in m:
            self.times.append(step_time(m))
        if _finite(m.get("logp_gap_mean")):
            self.gaps.append(m["logp_gap_mean"])
        fired = []
        for name, msg in conditions.items():
            if msg is None:
                self.active.discard(name)
            elif name not in self.active:
                self.active.add(name)
                last = self.fired_at.get(name)
                if name == "slow_step" and last is not None and step - last < self.t.slow_cooldown:
                    continue
                self.fired_at[name] = step
                self.fired[name] = self.fired.get(name, 0) + 1
                fired.append(f"step {step}: {msg}")
        return fired


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _clip(c: Canaries, step: int, m: dict) -> str | None:
    frac = m.get("clip_frac_low", 0.0) + m.get("clip_frac_high", 0.0)
    if frac > c.t.clip_frac:
        return (
            f"{frac:.0%} of tokens clipped (low {m.get('clip_frac_low', 0.0):.0%}, high "
            f"{m.get('clip_frac_high', 0.0):.0%}; > {c.t.clip_frac:.0%}): the policy that sampled has drifted "
            f"from the one being trained (too many minibatches/epochs, lr too high, or stale weights)"
        )
    return None


def _slow(c: Canaries, step: int, m: dict) -> str | None:
    k = c.t.recent
    if "time/generate" not in m or len(c.times) < c.t.min_history + k - 1:
        return None
    times = list(c.times) + [step_time(m)]
    t, base = median(times[-k:]), median(times[:-k])
    slow = t > c.t.slow_factor * base and t >= c.t.min_step_s
    c.slow_streak = c.slow_streak + 1 if slow else 0
    if c.slow_streak >= c.t.sustain:
        worst = max((key for key in m if key.startswith("time/")), key=m.__getitem__)
        return (
            f"steps now take {t:.2f}s (median of the last {k}), {t / base:.1f}x the median {base:.2f}s of "
            f"the {len(times) - k} before, for {c.slow_streak} steps (longest phase now: "
            f"{worst.split('/', 1)[1]} {m[worst]:.2f}s): another job on this machine, a growing cache "
            f"or a slower reward function"
        )
    return None


def _gap(c: Canaries, step: int, m: dict) -> str | None:
    gap = m.get("logp_gap_mean")
    if not _finite(gap) or len(c.gaps) < c.t.min_history:
        return None
    base = median(c.gaps)
    if gap > c.t.gap_floor and gap > c.t.gap_factor * base:
        return (
            f"trainer vs vLLM log-prob gap {gap:.2e} is {gap / max(base, 1e-12):.0f}x its median {base:.2e}: "
            f"vLLM sampled with weights the trainer does not have (check the hand-off of step {step - 1})"
        )
    return None


def _nonfinite(c: Canaries, step: int, m: dict) -> str | None:
    bad = [f"{k}={m[k]}" for k in ("loss", "grad_norm") if k in m and not _finite(m[k])]
    if m.get("nonfinite_steps", 0) > 0:  # the trainer's count of updates DeepSpeed discarded
        bad.append(f"{int(m['nonfinite_steps'])} optimizer update(s) skipped")
    if bad:
        return f"{' and '.join(bad)}: the update is not finite (lower train.lr, set train.grad_clip, or use float32)"
    return None


def _reward_errors(c: Canaries, step: int, m: dict) -> str | None:
    n, t = m.get("reward_errors", 0), m.get("reward_timeouts", 0)  # each also in reward_dead_letter.jsonl
    if (n and n > 0) or (t and t > 0):
        what = " and ".join(x for x in (f"raised on {int(n)}" if n else "", f"timed out on {int(t)}" if t else "") if x)
        return (
            f"the reward function {what} samples (scored 0); "
            f"--reward.on_error raise stops at the first one with its traceback"
        )
    return None


def _truncated(c: Canaries, step: int, m: dict) -> str | None:
    frac = m.get("truncated_frac")
    if _finite(frac) and frac > c.t.truncated_frac:
        return (
            f"{frac:.0%} of this step's completions hit rollout.max_new_tokens before an EOS or stop string: "
            f"the rewards judge cut-off answers; raise rollout.max_new_tokens (or mask them: "
            f"algo.overlong_filter)"
        )
    return None


CHECKS = {
    "clip": _clip,
    "truncated": _truncated,
    "slow_step": _slow,
    "logp_gap": _gap,
    "nonfinite": _nonfinite,
    "reward_errors": _reward_errors,
}
