"""hybridrl: a colocated hybrid-engine RL trainer (vLLM rollout + DeepSpeed training per rank).

    import hybridrl
    summary = hybridrl.train(hybridrl.Config())           # the embedded demo, in this process
    summary = hybridrl.train(overrides={"train.steps": 50})

The loop is in hybridrl/run/loop.py; start reading there.
"""

from __future__ import annotations

from hybridrl.run.config import Config, load as load_config

__version__ = "0.1.0"
__all__ = ["Config", "load_config", "train"]


def train(config: Config | str | None = None, overrides: dict | None = None) -> dict:
    """Train in the calling process (a notebook, a script under torchrun/accelerate)."""
    from hybridrl.run import environ as env
    from hybridrl.observe import preflight
    from hybridrl.run.config import apply
    if isinstance(config, str):
        config = load_config(config, overrides)
    elif overrides:
        config = apply(config or Config(), overrides)
    config = config or Config()
    env.setup(verbose=config.log.verbose)  # before torch/vLLM/DeepSpeed are imported by the loop
    preflight.check(config)  # a missing file or a bad reward module fails now, not after the imports
    from hybridrl.run import launch
    from hybridrl.run.loop import train as _train
    try:
        return _train(config)
    finally:
        launch.forget_world()  # RANK/MASTER_* of the world of one: gone, as before the call
