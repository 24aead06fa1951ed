"""hybridrl: a colocated hybrid-engine RL trainer (vLLM rollout + DeepSpeed training per rank).

    import hybridrl
    summary = hybridrl.train(hybridrl.Config())           # the embedded demo, in this process
    summary = hybridrl.train(overrides={"train.steps": 50})

The public API is the names in `__all__` (docs/api.md): what a notebook, a launcher script, a
reward file or an environment imports. They stay importable from here whatever moves inside the
package; the modules behind them (hybridrl/run/, engines/, ...) may move. `import hybridrl` stays
light: each name is imported on first use, so a reward worker that imports `hybridrl` pays for
the verifiers alone, not for the config tree, torch or vLLM.

The loop is in hybridrl/run/loop.py; start reading there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports on first use
    from hybridrl.core.config import Config, ConfigError, UserError, load as load_config  # noqa: F401
    from hybridrl.data.envs import PythonEnv, ToolEnv, python as python_tool  # noqa: F401
    from hybridrl.data.rewards import batched  # noqa: F401
    from hybridrl.data.verifiers import exact_match, extract_answer, format_check, last_boxed, math_verify  # noqa: F401

__version__ = "0.1.0"

# public name -> (the module that defines it, its name there)
_PUBLIC = {
    "Config": ("hybridrl.core.config", "Config"),  # the config tree (every setting: hybridrl train --help)
    "load_config": ("hybridrl.core.config", "load"),  # YAML + dotted overrides -> Config
    "ConfigError": ("hybridrl.core.config", "ConfigError"),  # a bad setting, one line naming the fix
    "UserError": ("hybridrl.core.config", "UserError"),  # any error of the user's input (ConfigError's base)
    "ToolEnv": ("hybridrl.data.envs", "ToolEnv"),  # the environment base class for env.cls (multi-turn, tools)
    "PythonEnv": ("hybridrl.data.envs", "PythonEnv"),  # a ToolEnv whose one tool runs the model's code, sandboxed
    "python_tool": ("hybridrl.data.envs", "python"),  # that tool: python(code) -> what it printed
    "batched": ("hybridrl.data.rewards", "batched"),  # marks fn(prompts, completions, answers) -> list[float]
    "exact_match": ("hybridrl.data.verifiers", "exact_match"),  # the built-in verifiers, fn(prompt, completion, answer)
    "math_verify": ("hybridrl.data.verifiers", "math_verify"),
    "format_check": ("hybridrl.data.verifiers", "format_check"),
    "extract_answer": ("hybridrl.data.verifiers", "extract_answer"),  # a solution's final answer, as a grader reads it
    "last_boxed": ("hybridrl.data.verifiers", "last_boxed"),
}
__all__ = ["train", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hybridrl' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def train(config: Config | str | None = None, overrides: dict | None = None) -> dict:
    """Train in the calling process (a notebook, a script under torchrun/accelerate)."""
    from hybridrl.core import environ
    from hybridrl.core.config import Config, apply, load
    from hybridrl.run import preflight

    if isinstance(config, str):
        config = load(config, overrides)
    elif overrides:
        config = apply(config or Config(), overrides)
    config = config or Config()
    environ.setup(verbose=config.log.verbose)  # before torch/vLLM/DeepSpeed are imported by the loop
    preflight.check(config)  # a missing file or a bad reward module fails now, not after the imports
    from hybridrl.core import launch
    from hybridrl.run.loop import train as _train

    try:
        return _train(config)
    finally:
        launch.forget_world()  # RANK/MASTER_* of the world of one: gone, as before the call
