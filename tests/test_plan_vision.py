"""The memory plan of a vision-language model (cycle/shape.py's Tower, cycle/plan.py): the shipped
Qwen2.5-VL-7B and Qwen3-VL-8B configs counted exactly against transformers' classes on the meta
device, and a plan larger than its text model's by the tower's terms and nothing else. Pure
arithmetic on config.json (and a meta-device build): no engine starts here."""

import pytest

from hybridrl.core import models
from hybridrl.cycle.shape import read_config

pytestmark = pytest.mark.fast


def test_count_params_builds_the_vision_family_class():
    """models.inspect's count (the recipe's printed size): AutoModelForCausalLM maps no Qwen-VL type, so it
    counted 0; the family's class counts the whole model."""
    from transformers import AutoConfig

    conf = AutoConfig.for_model(**read_config("Qwen/Qwen2.5-VL-7B-Instruct"))
    assert models._count_params(conf, False) == (8_292_166_656, True)
