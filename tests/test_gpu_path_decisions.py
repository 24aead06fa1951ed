"""Decisions of the 8xH100 path that a CPU run never exercises (issue 47, items 1, 3 and 8), checked
as decisions: the config check and the plan's choice for DeepSpeed's parameter offload, the thread
count DeepSpeed's CPU Adam gets under torchrun, the watchdog's limit for a checkpoint's bytes. No
engine starts here."""

import pytest

from hybridrl.cycle import plan
from hybridrl.run import config
from hybridrl.run.config import ConfigError

from tests.test_plan import H100, NODE, gpu_config, shape

pytestmark = pytest.mark.fast


# --- item 1: train.param_offload needs the optimizer in host memory -----------------------------
def test_param_offload_with_the_optimizer_on_the_device_is_refused():
    """DeepSpeed's engine.offload_states asserts `offload_param` is off; the trainer calls it whenever
    the optimizer is on the device, so the pair would crash at the first hand-off on a GPU."""
    with pytest.raises(ConfigError, match="train.param_offload=on needs .* set train.optimizer_offload on or auto"):
        config.load(None, {"train.param_offload": "on", "train.optimizer_offload": "off"})
    config.load(None, {"train.param_offload": "on", "train.optimizer_offload": "on"})
    config.load(None, {"train.param_offload": "off", "train.optimizer_offload": "off"})


def test_param_offload_alone_plans_the_optimizer_on_the_host_too():
    """A user who sets only train.param_offload (verl habits) gets the optimizer on the host as well:
    the plan's first candidate used to be the pair DeepSpeed refuses, and it fits a 7B on 8 GPUs."""
    cfg = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"train.param_offload": "on", "train.zero_stage": 3})
    cfg, p = plan.decide(cfg, shape("Qwen/Qwen2.5-7B-Instruct"), device=H100, host=NODE, world=8, local=8,
                         on_cpu=False)
    assert p.fits and p.knobs.param_offload and p.knobs.optimizer_offload
    assert cfg.train.optimizer_offload == "on" and cfg.sources["train.optimizer_offload"] == "memory plan"
