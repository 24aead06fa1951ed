"""What each algorithm component is, declared once, in the file that defines it.

A policy loss or an advantage estimator registers a spec here when its module is imported (the
package's `__init__` imports them all). Everything else reads the spec's properties instead of
comparing names: the schema's choices and help, `config.validate`, the recipe's clip range, the plan's
and the loop's critic, the fused pass's chunking, Liger's mapping and the trainer's hyperparameters.
The models are verl's `core_algos` registries (a name -> function table) and prime-rl's per-algorithm
config classes (each loss's own hyperparameters as a dataclass).

Nothing here or in the declaring modules imports torch at module level: the config reads these specs
before torch is loaded (`hybridrl train --help`, `hybridrl plan`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable


def reads(default: Any, key: str) -> Any:
    """A hyperparameter field of a loss's params dataclass, read from the config key `key` (algo.*; the
    knob itself, its help and range, is the schema's)."""
    return field(default=default, metadata={"knob": key})


@dataclass(frozen=True)
class Liger:
    """How Liger-Kernel's fused GRPO loss (train.kernels=liger) computes a policy loss.

    level: its importance_sampling_level; loss_type: a loss_type of its own that replaces the
    aggregation's (cispo); eps: the loss's params -> Liger's (epsilon_low, epsilon_high);
    needs(algo) -> why Liger would compute another loss under these algo.* settings ('' when it would not)."""

    level: str
    eps: Callable[[Any], tuple[float, float]] = lambda p: (p.eps_low, p.eps_high)
    loss_type: str | None = None
    needs: Callable[[Any], str] = lambda algo: ""


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: per-token policy term, before the IS weight and the aggregation.

    term(logp, old, adv, tok, p) -> [n]: `tok` is kernels.ppo_loss's per-token view (mask, sequence
    index, ...), `p` an instance of `params`. ratio(logp, old, tok) -> [n]: the ratio its metrics
    report (ratio_*). clip_fracs(ratio, adv, p) -> (low, high) bool [n]: the tokens whose gradient
    (or weight) its lower / upper clip bounds."""

    name: str
    summary: str  # one line for the schema's help and docs/configuration.md
    term: Callable
    ratio: Callable
    clip_fracs: Callable
    params: type  # a frozen dataclass of its own hyperparameters, each field `reads` its algo.* key
    sequence: bool = False  # reads a whole sequence's current log-probs at once (a sequence ratio)
    clip: tuple[float, float] | None = None  # its own (algo.clip_low, algo.clip_high) where the user set neither
    liger: Liger | None = None  # None: train.kernels=liger cannot compute it

    def knobs(self) -> dict[str, str]:
        """params field -> the config key it is read from."""
        return {f.name: f.metadata["knob"] for f in dataclasses.fields(self.params)}


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: fn(Experience) -> (advantages [B] or [B, T], returns [B, T] or None)."""

    name: str
    summary: str
    fn: Callable
    per_token: bool = False  # one advantage per completion token (else one per sample, from its group)
    critic: bool = False  # reads a value model's values: the run loads and trains a critic


POLICY_LOSSES: dict[str, PolicyLoss] = {}
ESTIMATORS: dict[str, Estimator] = {}


def register(spec: PolicyLoss | Estimator) -> PolicyLoss | Estimator:
    table: dict = POLICY_LOSSES if isinstance(spec, PolicyLoss) else ESTIMATORS
    if spec.name in table:
        raise ValueError(f"{type(spec).__name__} {spec.name!r} is declared twice")
    table[spec.name] = spec
    return spec


def policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy_loss={name!r}; choose from {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"advantage={name!r}; choose from {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def loss_params(spec: PolicyLoss, values: dict[str, Any]) -> Any:
    """The loss's params from keyword values (missing ones take the field's default)."""
    return spec.params(**{f.name: values[f.name] for f in dataclasses.fields(spec.params) if f.name in values})


def param_names() -> set[str]:
    """Every registered loss's hyperparameters: what ppo_loss accepts by keyword besides its own."""
    return {f.name for spec in POLICY_LOSSES.values() for f in dataclasses.fields(spec.params)}
