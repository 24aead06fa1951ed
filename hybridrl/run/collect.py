"""Collect one training batch: generate, score each sample as it finishes, shape, filter.

`Collector.batch(step, phases)` runs one or more generation rounds on this rank's share of the
prompts. Every finished sample is decoded and handed to the reward Scorer while vLLM keeps
generating the others (rewards.py: a slow verifier runs beside generation, not after it). Then:
- reward models (`rm:PATH` terms of reward.fn): all of the round's samples are scored on the
  device in the `reward_model` phase, after the rule-based terms, and added by weight;
- DAPO overlong shaping (`algo.overlong_buffer`): a length penalty is added to each reward;
- DAPO dynamic sampling (`algo.dynamic_sampling`): groups whose rewards are all equal are
  dropped and more prompts are generated, up to `algo.dynamic_sampling_max_rounds` rounds,
  until the ranks together hold `train.prompts_per_step` groups; every decision comes from
  all-reduced counts, so all ranks run the same number of rounds;
- DAPO overlong filtering (`algo.overlong_filter`): samples cut off at the length limit are
  marked `masked` (no gradient).
Prompts vLLM refuses are dropped and counted (`dropped_prompts`). With `env.cls` each sample is a
multi-turn episode (multiturn.py): the reward functions score its final assistant message, and the
environment's own rewards are added.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from hybridrl.algorithms import dapo
from hybridrl.core import launch
from hybridrl.core.config import Config, UserError, completion_budget
from hybridrl.data import partial
from hybridrl.data.batch import Sample
from hybridrl.data.images import Vision
from hybridrl.data.prompts import Prompt, Sampler
from hybridrl.data.rewards import Scorer
from hybridrl.engines import reward_model
from hybridrl.engines.reward_model import RewardModel
from hybridrl.engines.rollout import Rollout
from hybridrl.observe.progress import Phases
from hybridrl.run import multiturn

log = logging.getLogger("hybridrl")


def images_of(prompts: list[Prompt]) -> list[tuple] | None:
    """The prompts' images for vLLM (Rollout.generate's images=), None when none has any."""
    return [p.images for p in prompts] if any(p.images for p in prompts) else None


def single_turn_greedy(rollout, tokenizer, prompts: list, max_tokens: int) -> tuple[list[str], list[float]]:
    """vLLM's greedy answers to `prompts`, decoded, and their environment rewards (none: 0)."""
    # with no prompts too: a TP group asks together
    outs = rollout.greedy([p.ids for p in prompts], max_tokens, images=images_of(prompts))
    return tokenizer.batch_decode(outs, skip_special_tokens=True), [0.0] * len(prompts)


@dataclass
class Rollouts:
    """This rank's training groups, group-major: sample j of group g is samples[g * n + j]."""

    prompts: list[Prompt]  # [G]
    samples: list[Sample]  # [G * n]
    rewards: torch.Tensor  # [G, n] final rewards (overlong penalty included)
    masked: torch.Tensor  # [G * n] bool: carries no gradient (overlong-filtered, or this rank's filler group)
    metrics: dict[str, float]  # summed or averaged over all ranks
    # a vision-language model's: each sample's images as the trainer takes them (images.Vision.pixels;
    # a group's samples share their prompt's, a multi-turn episode whose turns hold images has its own),
    # None for a sample without; [] for a text model
    pixels: list = field(default_factory=list)

    def prompt_ids(self) -> list[list[int]]:
        """Each sample's prompt as vLLM ran it (a vision-language prompt with its images expanded)."""
        n = len(self.samples) // max(len(self.prompts), 1)
        return [s.prompt_ids or self.prompts[i // n].ids for i, s in enumerate(self.samples)]

    def row_pixels(self) -> list | None:
        """Each sample's pixels (Batch.from_rows' pixels); None for a text model."""
        return list(self.pixels) if self.pixels else None


@dataclass
class _Group:
    prompt: Prompt
    samples: list[Sample]
    raw: list[float]  # the reward functions' values
    rewards: torch.Tensor  # [n] after shaping


class Collector:
    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        scorer: Scorer,
        tokenizer,
        prompts: list[Prompt],
        sampler: Sampler,
        world,
        models: list[tuple[str, float, RewardModel]] | None = None,
        vision: Vision | None = None,
    ):
        """`vision`: how a vision-language model takes images (the trainer's pixels of each prompt)."""
        self.cfg, self.rollout, self.scorer, self.tokenizer = cfg, rollout, scorer, tokenizer
        self.vision = vision
        self.prompts, self.sampler, self.world = prompts, sampler, world
        # (name, weight, model) per rm: term; the loop loads them before vLLM is planned
        self.models = reward_model.load_all(cfg, world.device) if models is None else models
        self.model_sums = {name: 0.0 for name, _, _ in self.models}  # this step's sum of each RM's scores
        self.episodes = (
            multiturn.Episodes(cfg, rollout, tokenizer, rank=world.rank, run_dir=scorer.run_dir, vision=vision)
            if cfg.env.cls
            else None
        )  # multi-turn: an environment between assistant turns
        # rollout.partial: groups in flight between steps (partial.py); the checkpoint holds them
        self.buffer = partial.Buffer() if cfg.rollout.partial == "on" else None

    def batch(self, step: int, phases: Phases) -> Rollouts:
        cfg, a, world = self.cfg, self.cfg.algo, self.world
        target, n = cfg.train.prompts_per_step, cfg.rollout.n
        self.scorer.step = step
        # start this step's error counts from zero (the held-out eval's are in the dead-letter file)
        self.scorer.counts()
        self.model_sums = dict.fromkeys(self.model_sums, 0.0)
        if self.episodes:
            self.episodes.step = step
            self.episodes.counts()
        seen: list[list[_Group]] = []  # every round's scored groups
        rejected = []

        def rounds():  # each pull generates and scores one more round
            while True:
                groups, dropped = (self._round_partial if self.buffer else self._round)(step, phases)
                seen.append(groups)
                rejected.append(dropped)
                yield torch.stack([g.rewards for g in groups]) if groups else torch.zeros(0, n)

        plan = dapo.fill(
            rounds(),
            target,
            a.dynamic_sampling_max_rounds,
            dynamic=a.dynamic_sampling,
            rank=world.rank,
            world_size=world.size,
            all_sum=launch.all_sum,
        )
        kept = [seen[r][g] for r, g in plan.kept]
        every = [g for groups in seen for g in groups]
        filler = not kept
        if filler:  # this rank keeps one group with no gradient so it stays in the trainer's collectives
            if not every:
                raise UserError(
                    "vLLM rejected every prompt of this rank's batch; see the warnings above "
                    "(prompts longer than rollout.max_model_len, or token ids outside the vocabulary)"
                )
            kept = every[:1]
        samples = [s for g in kept for s in g.samples]
        truncated = torch.tensor([not s.finished for s in samples])
        masked = truncated if a.overlong_filter else torch.zeros(len(samples), dtype=torch.bool)
        masked |= filler
        out = self._metrics(every, [] if filler else kept, sum(rejected), plan)
        if self.buffer:  # the tokens generated this step (a carried sample's earlier ones were counted then)
            c = self.buffer.counts
            sums = launch.all_sum(
                [
                    c["generated"],
                    c["aborted"],
                    c["carried"],
                    c["continued"],
                    c["expired"],
                    0 if filler else len(kept),
                    c["held"],
                ]
            )  # trained: the share, or a few more
            # vllm_requests_held: what vLLM still holds after the abort, 0 unless cut requests leak
            out.update(
                rollout_tokens=sums[0],
                **{
                    f"partial/{k}": v
                    for k, v in zip(
                        (
                            "aborted_samples",
                            "carried_groups",
                            "continued_samples",
                            "expired_groups",
                            "trained_groups",
                            "vllm_requests_held",
                        ),
                        sums[1:],
                    )
                },
            )
            out.update(partial.metrics(samples, partial.version_of(step), self.cfg.rollout.partial_max_age))
        pixels = [px for g in kept for px in self._pixels(g)] if self.vision else []
        return Rollouts([g.prompt for g in kept], samples, torch.stack([g.rewards for g in kept]), masked, out, pixels)

    def _pixels(self, g: _Group) -> list:
        """Each of the group's samples' images as the trainer takes them, at the ids vLLM expanded them
        to: its prompt's, one Pixels for the group; a multi-turn episode's, those of its prompt where its
        turns hold none (shared by the episodes of the same prompt), else of its whole sequence."""
        if not self.episodes:
            px = self.vision.pixels(g.prompt.images, g.samples[0].prompt_ids) if g.prompt.images else None
            return [px] * len(g.samples)
        out, seen = [], {}
        for s in g.samples:
            if not s.images:
                out.append(None)
                continue
            later = self.vision.image_token_id in s.token_ids
            ids = s.prompt_ids + s.token_ids if later else s.prompt_ids
            key = (tuple(map(id, s.images)), tuple(ids))
            if key not in seen:
                seen[key] = self.vision.pixels(s.images, ids)
            out.append(seen[key])
        return out

    def _round(self, step: int, phases: Phases) -> tuple[list[_Group], int]:
        """Generate n samples for each of this rank's share of `prompts_per_step` new prompts and
        score them; returns the scored groups and how many prompts vLLM rejected."""
        cfg, w, n = self.cfg, self.world, self.cfg.rollout.n
        index = self.sampler.next(cfg.train.prompts_per_step)[w.rank :: w.size]  # dataset rows, this rank's share
        batch = [self.prompts[i] for i in index]
        pending: dict[int, list[Sample | None]] = {i: [None] * n for i in range(len(batch))}
        with phases("generate"):  # vLLM is awake: the hand-off (or engine start) woke it
            kw = dict(
                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_new_tokens
            )
            gen = (
                self.episodes.generate(batch, n, index, **kw)
                if self.episodes
                else self.rollout.generate([p.ids for p in batch], n, **kw, images=images_of(batch))
            )
            for i in gen.rejected:
                del pending[i]
            for finished in gen:
                for s in finished:
                    if s.prompt_idx not in pending:
                        continue
                    group = pending[s.prompt_idx]
                    group[s.sample_idx] = s
                    p, meta = batch[s.prompt_idx], {"prompt_index": index[s.prompt_idx]}
                    if not self.scorer.batched:  # score it now, while the engine generates the rest
                        self.scorer.submit(
                            (s.prompt_idx, s.sample_idx),
                            p.text,
                            [self._text(s)],
                            p.answer,
                            {**meta, "sample": s.sample_idx},
                        )
                    elif all(group):  # a batched reward takes the whole group at once
                        self.scorer.submit((s.prompt_idx, None), p.text, [self._text(x) for x in group], p.answer, meta)
                self.scorer.poll()
        with phases("reward"):  # what the verifiers have not finished by the end of generation
            scores = self.scorer.wait()
        return self._scored(batch, pending, scores, phases), len(gen.rejected)

    def _scored(self, batch, pending: dict[int, list[Sample]], scores: dict, phases: Phases) -> list[_Group]:
        """The groups of `pending` (key -> its n samples; `batch[key]` its prompt) with their rewards: the
        verifiers' `scores`, the reward models', the environment's and the overlong penalty."""
        cfg, n = self.cfg, self.cfg.rollout.n
        raws = {i: scores[(i, None)] if self.scorer.batched else [scores[(i, j)][0] for j in range(n)] for i in pending}
        if self.models:
            with phases("reward_model"):
                self._add_model_scores(batch, pending, raws)
        groups = []
        for i, samples in pending.items():
            raw = [x + s.env_reward for x, s in zip(raws[i], samples)]  # 0 without an environment
            lengths = torch.tensor([len(s.token_ids) for s in samples])
            shaped = torch.tensor(raw) + dapo.overlong_penalty(
                lengths, completion_budget(cfg), cfg.algo.overlong_buffer, cfg.algo.overlong_penalty
            )
            groups.append(_Group(batch[i], samples, raw, shaped))
        return groups

    def _round_partial(self, step: int, phases: Phases) -> tuple[list[_Group], int]:
        """rollout.partial: continue the carried groups and start fresh ones, stop vLLM once this rank's
        share of prompts_per_step groups is complete (and every group at the staleness cap is), keep the
        rest for the next step (partial.py); returns the complete groups, scored, and the prompts vLLM
        rejected. A complete group is trained once, in the step that completes it."""
        cfg, w, r, n = self.cfg, self.world, self.cfg.rollout, self.cfg.rollout.n
        version, target = partial.version_of(step), len(range(w.rank, cfg.train.prompts_per_step, w.size))
        carried, expired = partial.triage(self.buffer.groups, version, r.partial_max_age)
        # fresh rows from the shared sampler: every rank draws its count, in rank order, from one draw
        want = partial.to_issue(target, r.partial_oversample, len(carried))
        draw = max(0, want - len(expired))  # an expired group's prompt starts again, from scratch
        counts = [0.0] * w.size
        counts[w.rank] = float(draw)
        counts = [int(x) for x in launch.all_sum(counts)]
        rows = self.sampler.next(sum(counts)) if sum(counts) else []
        start = sum(counts[: w.rank])
        rows = [g.index for g in expired] + list(rows[start : start + draw])
        new = [partial.fresh(i, n, version) for i in rows]
        groups = carried + new  # generation's prompt index: a new group i is 0.., a carried group g is len(new) + g
        continued = partial.continuations(
            carried, [self.prompts[g.index].ids for g in carried], r.max_new_tokens, first=len(new)
        )
        waiting = {id(g) for g in carried if partial.must_finish(g, version, r.partial_max_age)}
        complete: list[int] = []  # indices into groups
        before = sum(len(s.token_ids) for g in carried for s in g.samples if s is not None)

        def at(i: int) -> int:  # generation's prompt index -> index into groups
            return len(carried) + i if i < len(new) else i - len(new)

        with phases("generate"):  # vLLM is awake: the hand-off (or engine start) woke it
            gen = self.rollout.generate_partial(
                [self.prompts[g.index].ids for g in new],
                n,
                continued,
                temperature=r.temperature,
                top_p=r.top_p,
                max_tokens=r.max_new_tokens,
            )
            rejected = {at(i) for i in gen.rejected}
            for finished in gen:
                for s in finished:
                    k = at(s.prompt_idx)
                    g = groups[k]
                    partial.put(g, s.sample_idx, s, version, done=True)
                    if g.complete:
                        complete.append(k)
                        waiting.discard(id(g))
                        p = self.prompts[g.index]
                        meta = {"prompt_index": g.index}
                        if self.scorer.batched:
                            self.scorer.submit((k, None), p.text, [self._text(x) for x in g.samples], p.answer, meta)
                        else:
                            for j, x in enumerate(g.samples):
                                self.scorer.submit((k, j), p.text, [self._text(x)], p.answer, {**meta, "sample": j})
                self.scorer.poll()
                if partial.enough(len(complete), target, len(waiting)):
                    break
            cut = gen.abort() if gen.requests else []
            for s, done in cut:
                partial.put(groups[at(s.prompt_idx)], s.sample_idx, s, version, done)
        with phases("reward"):
            scores = self.scorer.wait()
        self.buffer.groups = [g for k, g in enumerate(groups) if k not in rejected and not g.complete]
        after = sum(len(s.token_ids) for g in groups for s in g.samples if s is not None)
        self.buffer.counts = dict(
            generated=after - before,
            aborted=sum(not d for _, d in cut),
            carried=len(self.buffer.groups),
            continued=len(continued),
            expired=len(expired),
            held=self.rollout.requests_held(),
        )
        pending = {k: groups[k].samples for k in complete}
        batch = {k: self.prompts[groups[k].index] for k in complete}
        return self._scored(batch, pending, scores, phases), len(rejected)

    def _add_model_scores(
        self, batch: list[Prompt], pending: dict[int, list[Sample]], raws: dict[int, list[float]]
    ) -> None:
        """Each reward model scores every sample of the round at once (in its batches); weighted, the
        scores are added to the rule-based totals in `raws` (prompt index -> [n])."""
        keys = [(i, j) for i, samples in pending.items() for j in range(len(samples))]
        prompts = [batch[i].text for i, _ in keys]
        texts = [self._text(pending[i][j]) for i, j in keys]
        for name, weight, model in self.models:
            for (i, j), v, p, t in zip(keys, model.score(prompts, texts), prompts, texts):
                if not math.isfinite(v):  # an error like a reward function's: this term scores 0, counted
                    self.scorer.reject(
                        p, t, batch[i].answer, f"reward model {name} scored {v}, not a finite number", {"sample": j}
                    )
                    continue
                raws[i][j] += weight * v
                self.model_sums[name] += v

    def greedy(self, prompts: list[Prompt]) -> tuple[list[str], list[float]]:
        """The held-out evaluation's greedy completions, one per prompt, and the environment's rewards
        (0 without one). With an environment each is a whole episode, scored on its final message."""
        if not self.episodes:  # no prompts: still asked (a tensor-parallel group's ranks generate together)
            return single_turn_greedy(self.rollout, self.tokenizer, prompts, self.cfg.rollout.max_new_tokens)
        gen = self.episodes.generate(prompts, 1, temperature=0.0, top_p=1.0, max_tokens=self.cfg.rollout.max_new_tokens)
        got = {s.prompt_idx: s for finished in gen for s in finished}
        self.episodes.counts()  # training's metrics count training's episodes
        return [self._text(got[i]) if i in got else "" for i in range(len(prompts))], [
            got[i].env_reward if i in got else 0.0 for i in range(len(prompts))
        ]

    def _text(self, s: Sample) -> str:  # an episode's final assistant message
        return self.tokenizer.decode(multiturn.last_turn(s.token_ids, s.loss_mask), skip_special_tokens=True)

    def _metrics(self, seen: list[_Group], kept: list[_Group], dropped: int, plan: dapo.Fill) -> dict:
        """Over every sample generated this step (all rounds), summed over ranks."""
        samples = [s for g in seen for s in g.samples]
        shaped = torch.cat([g.rewards for g in seen]) if seen else torch.zeros(0)
        raw = torch.tensor([r for g in seen for r in g.raw])
        counts = {**self.scorer.counts(), **{f"reward/{k}": v for k, v in self.model_sums.items()}}
        terms = [k for k in counts if k.startswith("reward/")]
        no_signal = sum(not bool(dapo.mixed_groups(g.rewards[None])) for g in seen)
        lengths = [len(s.token_ids) for s in samples]
        sums = launch.all_sum(
            [
                len(samples),
                float(shaped.sum()),
                float((raw >= 1).sum()),
                sum(lengths),
                sum(not s.finished for s in samples),
                float((shaped - raw).sum()),
                dropped,
                counts["reward_errors"],
                counts["reward_timeouts"],
                len(kept),
                no_signal,
                *[counts[k] for k in terms],
            ]
        )
        num = max(sums[0], 1)
        out = dict(
            reward=sums[1] / num,
            solve_rate=sums[2] / num,
            rollout_tokens=sums[3],
            response_len=sums[3] / num,
            truncated_frac=sums[4] / num,
            dropped_prompts=sums[6],
            reward_errors=sums[7],
            reward_timeouts=sums[8],
        )
        out.update({k: v / num for k, v in zip(terms, sums[11:])})  # per-term means
        if self.cfg.algo.overlong_buffer:
            out["overlong_penalty"] = sums[5] / num
        if self.episodes:  # turns, tokens by role, truncations, tool calls / errors / timeouts / latency
            c = self.episodes.counts()
            out.update(multiturn.metrics(dict(zip(multiturn.COUNTS, launch.all_sum([c[k] for k in multiturn.COUNTS])))))
        if self.cfg.algo.dynamic_sampling:
            out.update(
                ds_rounds=plan.rounds,
                ds_groups_kept=sums[9],
                ds_groups_dropped=sums[10],
                ds_cap_hits=float(plan.cap_hit),
            )
        return out
