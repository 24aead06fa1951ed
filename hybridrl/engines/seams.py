"""What the memory cycle and the checkpointer ask of the engines, as Protocols, and the engines a rank
owns as one bundle.

engine_cycle.hand_off, release and plan_rollout, sync.push_weights and sync.probe, and the
checkpoint's save and restore call only the verbs below; mypy checks those callers against them
(`make lint`), and tests/test_seams.py checks that Trainer, Critic and Rollout have them. A new engine
is added in one place: a field of `Engines`, whose metadata says whether it leaves the device while
vLLM generates (`resident`) and which directory of a checkpoint it saves itself into (`checkpoint`);
the cycle and the checkpointer find it there (torchtitan registers its stateful parts the same way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from hybridrl.data.batch import Batch


@runtime_checkable
class Stateful(Protocol):
    """A part the checkpointer saves and restores: it writes its own directory under a checkpoint's."""

    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


@runtime_checkable
class Resident(Protocol):
    """A trainer-side model that leaves the device while vLLM generates and comes back after."""

    def offload(self) -> None: ...
    def reload(self) -> None: ...


@runtime_checkable
class PolicyTrainer(Protocol):
    """The policy's trainer, as the cycle sees it: its states leave and come back, its parameters go to
    vLLM in buckets, it scores the probe, and it measures what its states will take."""

    hf: Any  # the transformers model (its config sizes vLLM)
    compute_dtype: torch.dtype  # vLLM's dtype (the weights may be float32 under train.precision=amp)

    def offload(self, params: bool = False) -> None: ...
    def reload(self) -> None: ...
    def named_parameters_for_sync(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]: ...
    def pending_state_bytes(self) -> int: ...
    def logprobs(self, batch: Batch, temperature: float, ban: bool = True) -> torch.Tensor: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """vLLM, as the cycle sees it: its memory sleeps and wakes by tag, it takes the trainer's tensors,
    and it scores the probe's prompts."""

    def wake(self, tags: list[str]) -> None: ...
    def sleep(self, level: int) -> None: ...
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    # the last prompt_logprobs' sequences as vLLM ran them (a vision-language prompt's images expanded)
    expanded_prompts: list[list[int]]

    def prompt_logprobs(self, seqs: list[list[int]], images: list | None = None) -> list[list[float]]: ...
    def close(self) -> None: ...


@dataclass
class Engines:
    """The engines a rank owns. `rollout` is set once plan_rollout has sized vLLM (it is built after the
    trainer-side engines, whose memory the plan measures)."""

    trainer: PolicyTrainer = field(metadata={"checkpoint": "ds"})
    rollout: RolloutEngine | None = None
    critic: Any = field(default=None, metadata={"checkpoint": "critic", "resident": True})  # PPO's value model
    # frozen models that score the batch's tokens after the rollout: the batch fields each fills (a
    # teacher of algo.distill_loss full gives its hidden states too), its phase
    reference: Any = field(default=None, metadata={"scores": ("logp_ref",), "phase": "ref_logprob"})  # the KL's
    teacher: Any = field(
        default=None, metadata={"scores": ("logp_teacher", "hidden_teacher"), "phase": "teacher"}
    )  # algo.teacher
    reward_models: list = field(default_factory=list)  # rm: reward terms, scoring while vLLM is awake

    def residents(self) -> list[Resident]:
        """The trainer-side models besides the policy that leave the device while vLLM generates."""
        return [
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("resident") and getattr(self, f.name) is not None
        ]

    def scorers(self) -> list[tuple[str, tuple[str, ...], Any]]:
        """(phase, batch fields, model) of the frozen models that score every sampled token (the KL's
        reference, the distillation teacher), in field order; each holds nothing to checkpoint. The
        model's `logprobs(batch, temperature)` gives the first field, or a tuple of the first ones."""
        return [
            (f.metadata["phase"], f.metadata["scores"], getattr(self, f.name))
            for f in dataclasses.fields(self)
            if "scores" in f.metadata and getattr(self, f.name) is not None
        ]

    def stateful(self) -> dict[str, Stateful]:
        """Checkpoint directory -> the engine that saves itself there, for every engine this run has."""
        return {
            f.metadata["checkpoint"]: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if "checkpoint" in f.metadata and getattr(self, f.name) is not None
        }

    @property
    def live_rollout(self) -> RolloutEngine:
        if self.rollout is None:
            raise RuntimeError("the rollout engine is not built yet (plan_rollout sizes it first)")
        return self.rollout
