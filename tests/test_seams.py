"""The seams between the engines and the memory cycle (hybridrl/engines/seams.py): the engines have
every verb the cycle and the checkpointer call, with the same parameters (mypy checks the callers
against the Protocols in `make lint`), and the bundle finds its stateful and resident engines from
their declarations."""

import inspect

import pytest

from hybridrl.engines import critic, seams, trainer
from hybridrl.engines.critic import Critic
from hybridrl.engines.rollout import Rollout
from hybridrl.engines.seams import Engines
from hybridrl.engines.trainer import Trainer

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def _verbs(protocol) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(fn).parameters)[1:]
        for name, fn in vars(protocol).items()
        if callable(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize(
    "engine,protocols",
    [
        (Trainer, [seams.PolicyTrainer, seams.Stateful]),
        (Critic, [seams.Resident, seams.Stateful]),
        (Rollout, [seams.RolloutEngine]),
    ],
)
def test_the_engines_have_the_verbs_the_cycle_calls(engine, protocols):
    for protocol in protocols:
        for name, params in _verbs(protocol).items():
            assert hasattr(engine, name), f"{engine.__name__} has no {name} ({protocol.__name__})"
            theirs = list(inspect.signature(getattr(engine, name)).parameters)[1:]
            assert theirs[: len(params)] == params, (engine.__name__, name, theirs, params)


class _Part:
    def __init__(self, name):
        self.name, self.calls = name, []

    def offload(self):
        self.calls.append("offload")

    def reload(self):
        self.calls.append("reload")


def test_the_bundle_finds_its_stateful_and_resident_engines():
    policy, value = _Part("policy"), _Part("critic")
    assert Engines(policy).stateful() == {"ds": policy} and Engines(policy).residents() == []
    both = Engines(policy, critic=value, reference=_Part("ref"))
    assert both.stateful() == {"ds": policy, "critic": value}  # the reference is rebuilt, not saved
    assert both.residents() == [value]  # the policy's states move by the plan's decision, not always
    assert (trainer.TAG, critic.TAG) == ("ds", "critic")  # the directories each engine writes
    with pytest.raises(RuntimeError, match="not built yet"):
        both.live_rollout
