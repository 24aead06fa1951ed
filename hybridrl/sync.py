"""Weight hand-off from the trainer to vLLM, and the probe that proves it landed.

The only module that knows both engines. Tensors pass by reference inside the process: no
serialisation, no file, no transport. ZeRO-3 parameters are gathered in buckets while vLLM
copies them in (see `Trainer.named_parameters_for_sync`).
"""

from __future__ import annotations

import torch

from .batch import Batch
from .rollout import Rollout
from .trainer import Trainer


class StaleWeightsError(RuntimeError):
    """vLLM's weights do not match the trainer's after a hand-off."""


def push_weights(trainer: Trainer, rollout: Rollout, bucket_mb: int) -> None:
    rollout.update_weights(trainer.named_parameters_for_sync(bucket_mb << 20))


def probe_batch(seqs: list[list[int]]) -> Batch:
    """Score every token after the first of each sequence."""
    n = [len(s) for s in seqs]
    batch = Batch.from_rows([s[:1] for s in seqs], [s[1:] for s in seqs],
                            [[0.0] * (k - 1) for k in n], [0.0] * len(seqs))
    return batch


def probe(trainer: Trainer, rollout: Rollout, seqs: list[list[int]]) -> tuple[float, torch.Tensor]:
    """max |logp_vllm - logp_trainer| over a fixed probe batch, and vLLM's log-probs.

    Catches stale or partial weights after a hand-off (TRL#5312 lost weeks to this)."""
    batch = probe_batch(seqs)
    ours = trainer.logprobs(batch, temperature=1.0)[batch.loss_mask]  # [N]
    theirs = torch.tensor([x for row in rollout.prompt_logprobs(seqs) for x in row])  # [N]
    return float((ours - theirs).abs().max()), theirs
