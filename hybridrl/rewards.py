"""Reward functions: built-ins by name, or any `module:function(prompt, completion, answer)`.

A reward function that raises scores 0 for that sample (counted in the step metrics, the
first error shown) instead of killing a run that may be hours in; `reward.on_error=raise`
stops instead.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

from .config import ConfigError

log = logging.getLogger("hybridrl")

RewardFn = Callable[[str, str, str], float]


def exact_match(prompt: str, completion: str, answer: str) -> float:
    return float(completion.strip() == str(answer).strip())


def _arithmetic(prompt: str, completion: str, answer: str) -> float:
    from .tasks import arithmetic
    return arithmetic.reward(prompt, completion, answer)


BUILTIN: dict[str, RewardFn] = {"arithmetic": _arithmetic, "exact_match": exact_match}


def load(spec: str) -> RewardFn:
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ConfigError(f"reward.fn={spec!r}: use a built-in ({', '.join(BUILTIN)}) or module:function")
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"reward.fn={spec!r}: cannot import {module!r} ({e}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise ConfigError(f"reward.fn={spec!r}: module {module!r} has no function {name!r}") from None
    if not callable(fn):
        raise ConfigError(f"reward.fn={spec!r} is not callable")
    return fn


def score(fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str],
          on_error: str = "zero") -> tuple[list[float], int]:
    """Rewards for each sample and the number of samples whose reward function raised."""
    out, errors = [], 0
    for p, c, a in zip(prompts, completions, answers):
        try:
            out.append(float(fn(p, c, a)))
        except Exception as e:
            if on_error == "raise":
                raise
            if errors == 0:
                log.warning("reward function raised %r on prompt %r; scoring 0 (reward.on_error=zero)", e, p[:80])
            errors += 1
            out.append(0.0)
    return out, errors
