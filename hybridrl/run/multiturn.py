"""Multi-turn episodes in the colocated engine: assistant turns from vLLM, environment turns from
`env.cls` (envs.py), one token sequence per episode.

`Episodes.generate(prompts, n)` returns what `Rollout.generate` returns (iterate it for lists of
finished Samples; `.rejected`), so the collector scores and groups episodes like single-turn
samples. How an episode advances:
- every episode of the step is one request in the same engine; when its assistant turn stops on
  EOS the environment's `step` runs (the turns that finished in one engine step run together, each
  under `env.tool_timeout_s`), and its observation is rendered ALONE with the chat template
  (`render_turn`), tokenized, appended, and the episode re-enters the engine from its kept token
  ids: earlier turns are never re-tokenised, and the prefix cache serves their KV;
- an episode ends when the environment says done (or returns no observation), after
  `env.max_turns` assistant turns, when an assistant turn hits rollout.max_new_tokens without
  EOS, or when the next turn would not fit `env.max_tokens` / `rollout.max_model_len`; its slot
  in the engine is free at once;
- the sample's completion is assistant and environment tokens interleaved; `loss_mask` is 1 on
  the assistant's (their vLLM log-probs kept) and 0 on the environment's (log-prob 0.0: context,
  never trained on); `env_reward` is the sum of the environment's rewards.
An environment call that raises or hangs ends its episode (reward so far), counted (`env/errors`,
`env/timeouts`) and written to `<run dir>/env_dead_letter.jsonl` with the transcript; a reset that
fails drops its prompt like a prompt vLLM refuses. The run goes on.

The environment steps of one engine step are awaited before the engine steps again: a slow tool
stalls generation for up to its timeout, but the order of requests, and so the sampled tokens,
do not depend on tool latencies (a run is reproducible from its seed when its tools are).
With rollout.tensor_parallel_size > 1 each rank steps the environments of its own episodes (their
timeouts and failures included) and the group's ranks add all the next turns together, in rank
order, before the engine steps again (rollout.Generation), so the group's engines never diverge.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from hybridrl.core.config import Config, UserError, completion_budget
from hybridrl.core.journal import DEAD_LETTER_CAP, Journal
from hybridrl.data import envs, images as image_io, prompts
from hybridrl.data.batch import Sample
from hybridrl.data.images import Vision
from hybridrl.engines import vllm_compat
from hybridrl.engines.rollout import Generation, Rollout

log = logging.getLogger("hybridrl")
_A, _B = "\x00hybridrl-user\x00", "\x00hybridrl-assistant\x00"  # placeholders no real message contains
COUNTS = (
    "env/episodes",
    "env/turns",
    "env/assistant_tokens",
    "env/env_tokens",
    "env/truncated_turns",
    "env/truncated_length",
    "env/errors",
    "env/timeouts",
    "env/images",
    *envs.COUNTS,
)


def render_turn(tokenizer, messages: list[dict], placeholder: str | None = None) -> list[int]:
    """Token ids of an environment turn (`turn_text`, tokenized alone). The messages' contents are
    tokenized without special-token parsing: a tool that echoes '<|im_end|>' (or whatever the
    tokenizer's control tokens are) gives the model that text, never the control token, so it cannot
    end a turn or forge a role header; the template's own markup keeps its special tokens. A content
    may be a list of parts ({"type": "text", "text": ...}, {"type": "image", ...}): each image part
    becomes a vision-language model's `placeholder` (its one image token, which vLLM expands), the
    only way a turn holds one; a text-only model (no placeholder) takes no image."""
    specials = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
    pieces = [_pieces(c, placeholder) for c in contents]  # [(is_image, text)] per content; None: not one
    plain = all(isinstance(c, str) for c, p in zip(contents, pieces) if p is not None)
    if plain and not any(isinstance(c, str) and s in c for c in contents for s in specials):
        return tokenizer(turn_text(tokenizer, messages), add_special_tokens=False)["input_ids"]
    marks = [f"\x00hybridrl-content-{k}\x00" for k in range(len(messages))]
    masked = [{**m, "content": mark} if p is not None else m for m, p, mark in zip(messages, pieces, marks)]
    ids = []
    for piece in re.split("(\x00hybridrl-content-\\d+\x00)", turn_text(tokenizer, masked)):
        if piece in marks:  # a content: text only, and the placeholder of each image
            for image, text in pieces[marks.index(piece)] or []:
                ids += (
                    tokenizer(placeholder, add_special_tokens=False)["input_ids"]
                    if image
                    else tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                )
        elif piece:  # the template's markup
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def _pieces(content, placeholder: str | None) -> list[tuple[bool, str]] | None:
    """A message's content as [(is an image, its text)]: a string is one text; a list of parts each
    part. None for anything else (left to the template as it is). ValueError on a part that is
    neither text nor image, or an image for a text-only model."""
    if isinstance(content, str):
        return [(False, content)]
    if not isinstance(content, list):
        return None
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image" and placeholder is None:
            raise ValueError("an image in an environment turn, but the model is text-only")
        if kind not in ("text", "image"):
            raise ValueError(f"a content part must be {{'type': 'text' | 'image', ...}}, got {part!r:.100}")
        out.append((kind == "image", "" if kind == "image" else str(part.get("text", ""))))
    return out


def turn_images(messages: list[dict]) -> list:
    """The images of an environment turn's messages (their image parts' "image" values), in order."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image":
                if part.get("image") is None:
                    raise ValueError('an image part of an environment turn needs its "image" (PIL, bytes or a path)')
                out.append(part["image"])
    return out


def turn_text(tokenizer, messages: list[dict]) -> str:
    """An environment turn as the chat template renders it after an assistant message, up to the
    next assistant turn's header (add_generation_prompt): the text between the end of the
    assistant's EOS and the end of the rendering of [user, assistant, *messages]. What the
    template writes after EOS (Qwen's newline) belongs to this turn: the model stopped at EOS and
    never produced it."""
    base = [{"role": "user", "content": _A}, {"role": "assistant", "content": _B}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    full = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    end = before.find(_B) + len(_B)
    eos = tokenizer.eos_token or ""
    stop = before.find(eos, end) if eos else -1
    cut = stop + len(eos) if stop >= 0 else len(before)
    if not full.startswith(before[:cut]):
        raise UserError(
            "the tokenizer's chat template renders earlier messages differently once an environment "
            "turn follows them, so turns cannot be appended token by token; use a template whose "
            "rendering of a conversation extends its rendering of every prefix"
        )
    return full[cut:]


def last_turn(ids: list[int], mask: list[int] | None) -> list[int]:
    """The final assistant turn of an episode (its last run of loss tokens): what reward.fn scores."""
    if mask is None:
        return ids
    end = max((k + 1 for k, m in enumerate(mask) if m), default=0)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return ids[start:end]


def metrics(c: dict[str, float]) -> dict[str, float]:
    """The logged metrics from COUNTS summed over a step's episodes (and ranks)."""
    eps, calls = max(c["env/episodes"], 1.0), max(c["tools/calls"], 1.0)
    out = {k: v for k, v in c.items() if k not in ("env/turns", "tools/latency_s")}
    out.update(
        {
            "env/turns_per_episode": c["env/turns"] / eps,
            "tools/calls_per_episode": c["tools/calls"] / eps,
            "tools/latency_ms": 1000 * c["tools/latency_s"] / calls,
        }
    )
    return out


def _info(info) -> tuple[dict[str, float], list[dict]]:
    """An env.step's info -> (its counts, finite numbers of envs.COUNTS' keys; its dead-letter entries).
    Raises ValueError on anything else: the step counts as an error that ends its episode."""
    if info is None:
        return {}, []
    if not isinstance(info, dict):
        raise ValueError(f"info must be a dict, got {type(info).__name__}")
    counts = {}
    for k in envs.COUNTS:
        v = info.get(k, 0)
        if isinstance(v, (str, bytes)) or not math.isfinite(float(v)):
            raise ValueError(f"info[{k!r}]={v!r:.80} is not a finite number")
        counts[k] = float(v)
    errors = info.get("errors", [])
    if not (isinstance(errors, list) and all(isinstance(x, dict) for x in errors)):
        raise ValueError("info['errors'] must be a list of dicts")
    return counts, errors


@dataclass
class _Episode:
    i: int  # prompt index in the batch
    j: int  # sample index within the prompt's n
    env: Any
    prompt: list[int]
    row: int = 0  # its dataset row, for the dead letter
    ids: list[int] = field(default_factory=list)  # completion so far: assistant + environment tokens
    # a vision-language model's: the prompt's and the environment turns' images (fitted), the completion
    # as vLLM is fed it (each image one placeholder, where `ids` holds its expanded run), the prompt as
    # vLLM expanded it (its first output's), and the expanded prompt's length
    images: list = field(default_factory=list)
    feed: list[int] = field(default_factory=list)
    expanded: list[int] | None = None
    plen: int = 0
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    end: str = ""  # done | turns | length | error | timeout
    k: int = -1  # its request's prompt index in the engine's Generation


class Episodes:
    def __init__(
        self,
        cfg: Config,
        rollout: Rollout,
        tokenizer,
        *,
        rank: int = 0,
        run_dir: Path | None = None,
        vision: Vision | None = None,
    ):
        """`vision`: how a vision-language model takes images (its prompts' and environments' turns')."""
        self.cfg, self.rollout, self.tokenizer, self.rank, self.run_dir = cfg, rollout, tokenizer, rank, run_dir
        self.vision = vision
        self.env_cls = envs.load(cfg.env.cls)
        self.runner = envs.Runner()
        self.budget = completion_budget(cfg)
        # a ToolEnv's tools stop at tool_timeout_s and report it; the guard around the whole call comes
        # later, with room for a loaded machine's scheduling stalls, which can last seconds
        self.timeout = 2 * cfg.env.tool_timeout_s + 5.0
        self.step: int | None = None  # stamped into dead-letter entries
        self._counts = dict.fromkeys(COUNTS, 0.0)
        self._dead_letter = None

    def counts(self) -> dict[str, float]:
        """This rank's counters since the last call (fixed keys, COUNTS); resets them."""
        out, self._counts = self._counts, dict.fromkeys(COUNTS, 0.0)
        return out

    def close(self) -> None:
        self.runner.close()
        if self._dead_letter:
            self._dead_letter.close()

    # --- one step's episodes ------------------------------------------------------------------
    def generate(
        self,
        prompts: list,
        n: int,
        index: list[int] | None = None,
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int | None = None,
    ) -> "_Run":
        """n episodes per prompt (`data.Prompt`s; `index`: their dataset rows, for reset and the
        dead letter). Iterating the result yields each episode as one Sample when it ends (after each
        engine step, like Rollout.generate's Generation); `.rejected` names the prompts dropped."""
        index = index if index is not None else list(range(len(prompts)))
        eps = []
        for i, p in enumerate(prompts):
            for j in range(n):
                env = self.env_cls()
                if isinstance(env, envs.ToolEnv):
                    env.tool_timeout_s = self.cfg.env.tool_timeout_s
                eps.append(_Episode(i, j, env, p.ids, index[i], images=list(p.images), plen=p.length))
        rows = [
            {"prompt": prompts[e.i].text, "answer": prompts[e.i].answer, "index": index[e.i], "images": list(e.images)}
            for e in eps
        ]
        futures = [
            self.runner.submit(e.env.reset, row, timeout=self.timeout) if hasattr(e.env, "reset") else None
            for e, row in zip(eps, rows)
        ]  # all at once: they run concurrently
        deadline = time.monotonic() + self.timeout + 1.0  # concurrent calls, one deadline (after their own)
        for e, fut in zip(eps, futures):
            ok, messages = self._result(e, "reset", fut, deadline)
            if not ok:
                e.prompt = None
            elif messages is not None:
                e.prompt = self._first_turn(e, messages)
        served = [e for e in eps if e.prompt is not None]
        for k, e in enumerate(served):
            e.k = k
        room = [min(max_tokens, self.budget, self.cfg.rollout.max_model_len - e.plen) for e in served]
        gen = self.rollout.generate(
            [e.prompt for e in served],
            1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max(1, min(room, default=1)),
            seed=seed,
            images=[tuple(e.images) for e in served] if self.vision else None,
        )
        gen.grows = True  # next turns are added while it runs (a tensor-parallel group gathers them)
        rejected = {e.i: "the environment's reset failed" for e in eps if e.prompt is None}
        rejected.update({served[k].i: why for k, why in gen.rejected.items()})
        return _Run(self, gen, served, rejected)

    def _first_turn(self, e: _Episode, messages) -> list[int] | None:
        """The prompt's token ids from reset's messages (and, for a vision-language model, its images:
        `e.images`, `e.plen`); None (the prompt is dropped, counted and dead-lettered) when they are not
        a list of messages the chat template renders, or their images do not fill their placeholders."""
        try:
            if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
                raise TypeError(f"expected a list of {{role, content}} messages, got {messages!r:.200}")
            if self.vision is not None:
                messages, e.images = self._reset_images(messages, e.images)
            schemas = getattr(e.env, "schemas", None) or None
            ids = list(
                self.tokenizer.apply_chat_template(
                    messages, tools=schemas, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            if self.vision is not None:
                if ids.count(self.vision.image_token_id) != len(e.images):
                    raise ValueError(
                        f"their tokens hold {ids.count(self.vision.image_token_id)} image token(s) for "
                        f"{len(e.images)} image(s): place images with image parts or '{prompts.MARKER}' only"
                    )
                e.plen = len(ids) + sum(self.vision.tokens(im) - 1 for im in e.images)
            else:
                e.plen = len(ids)
            return ids
        except Exception as ex:  # noqa: BLE001 (user data)
            self._fail(e, "error", f"env.reset's messages could not be rendered: {type(ex).__name__}: {ex}")
            return None

    def _reset_images(self, messages: list[dict], given: list) -> tuple[list[dict], list]:
        """reset's messages with each content as text (each image the model's placeholder), and their
        images, fitted: an image part's own "image", else (and for each '<image>' in a text) the row's
        next one, `given`. ValueError where the row has too few."""
        vision, row, out, images = self.vision, iter(given), [], []

        def take(value=None):
            if value is not None:
                images.append(vision.fit(image_io.load(value)))
                return
            got = next(row, None)
            if got is None:
                raise ValueError(f"more images placed than the row's {len(given)}")
            images.append(got)

        for m in messages:
            content = m.get("content")
            if not isinstance(content, (str, list)):
                out.append(m)
                continue
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part.get("type") == "image":
                    take(part.get("image"))
                else:
                    for _ in range(str(part.get("text", "")).count(prompts.MARKER)):
                        take()
            text, _, _ = prompts.render(content, vision.placeholder)
            out.append({**m, "content": text})
        return out, images

    def _turn_images(self, obs: list[dict]) -> list:
        """An observation's images, loaded and fitted to the model (ValueError in one line if one is not)."""
        return [self.vision.fit(image_io.load(v)) for v in turn_images(obs)] if self.vision else []

    def expand(self, turn: list[int], pictures: list) -> list[int]:
        """`turn`'s ids with each image's placeholder made the run of tokens vLLM expands it to."""
        if not pictures:
            return turn
        pad = self.vision.image_token_id
        if turn.count(pad) != len(pictures):
            raise ValueError(f"the turn renders {turn.count(pad)} image token(s) for its {len(pictures)} image(s)")
        runs = iter([self.vision.tokens(im) for im in pictures])
        return [t for x in turn for t in ([pad] * next(runs) if x == pad else [x])]

    def result(self, fut, deadline: float):
        """fut's result, waiting until `deadline` at most (TimeoutError past it). Each call has its own
        timeout inside the runner's event loop, but an async tool that blocks that loop (time.sleep in
        an async def) stops those timeouts too: the blocked loop is then abandoned for a new one, and
        its calls time out here."""
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            fut.cancel()
            if not self.runner.responsive():
                log.warning(
                    "an environment call blocks the event loop of async tools (a blocking call in an async "
                    "def?); its calls time out and a new loop takes over"
                )
                self.runner = envs.Runner()
            raise

    def _result(self, e: _Episode, what: str, fut, deadline: float) -> tuple[bool, Any]:
        """(True, the call's result) or (False, None) after counting and dead-lettering a failure."""
        if fut is None:
            return True, None
        try:
            return True, self.result(fut, deadline)
        except TimeoutError:
            self._fail(e, "timeout", f"env.{what} returned nothing within {self.timeout:.1f} s")
        except Exception as ex:  # noqa: BLE001 (user code)
            self._fail(e, "error", f"env.{what} raised {type(ex).__name__}: {ex}")
        return False, None

    def _fail(self, e: _Episode, kind: str, error: str, **extra) -> None:
        if kind in ("timeout", "error"):
            self._counts["env/timeouts" if kind == "timeout" else "env/errors"] += 1
            if self._counts["env/errors"] + self._counts["env/timeouts"] == 1:
                log.warning("environment %s: %s; the episode ends (see env_dead_letter.jsonl)", kind, error)
        self._write(e, kind, error, **extra)

    def _write(self, e: _Episode, kind: str, error: str, **extra) -> None:
        if self.run_dir is None:
            return
        if self._dead_letter is None:  # a full disk or the cap: counted, the run goes on (journal.py)
            self._dead_letter = Journal(Path(self.run_dir) / "env_dead_letter.jsonl", DEAD_LETTER_CAP)
        text = self.tokenizer.decode((e.prompt or []) + e.ids, skip_special_tokens=False)
        entry = {
            "step": self.step,
            "rank": self.rank,
            "prompt_index": e.row,
            "sample": e.j,
            "turn": e.turns,
            "kind": kind,
            "error": error,
            **extra,
            "transcript": text,
        }
        self._dead_letter.write(entry)


class _Run:
    """The iteration of one step's episodes (see Episodes.generate)."""

    def __init__(self, owner: Episodes, gen: Generation, eps: list[_Episode], rejected: dict[int, str]):
        self.o, self.gen, self.eps, self.rejected = owner, gen, eps, rejected

    def __iter__(self) -> Iterator[list[Sample]]:
        o = self.o
        for finished in self.gen:
            ended, stepping = self._lost(), []
            for s in finished:
                e = self.eps[s.prompt_idx]
                if s.prompt_ids is not None:  # a vision-language model's: what vLLM made of its feed
                    if e.expanded is None:
                        e.expanded = s.prompt_ids
                    elif s.prompt_ids != e.expanded + e.ids:  # the trainer would place other image tokens
                        e.end = "error"
                        o._fail(e, "error", "vLLM expanded the episode's images into other tokens than the trainer")
                        ended.append(e)
                        continue
                e.ids += s.token_ids
                e.feed += s.token_ids
                e.logprobs += s.logprobs
                e.mask += [1] * len(s.token_ids)
                e.turns += 1
                o._counts["env/assistant_tokens"] += len(s.token_ids)
                if s.finished:
                    stepping.append((e, o.tokenizer.decode(s.token_ids, skip_special_tokens=True)))
                else:  # cut by rollout.max_new_tokens (or the budget) mid-turn
                    e.end = "length"
                    ended.append(e)
            futures = [o.runner.submit(e.env.step, text, timeout=o.timeout) for e, text in stepping]
            deadline = time.monotonic() + o.timeout + 1.0  # each call's own timeout comes first
            for (e, _), fut in zip(stepping, futures):
                if self._advance(e, fut, deadline):
                    ended.append(e)
            yield [self._sample(e) for e in ended]
        lost = self._lost()
        if lost:
            yield [self._sample(e) for e in lost]

    def _lost(self) -> list[_Episode]:
        """Episodes whose next turn the engine refused when a tensor-parallel group added it
        (Generation.lost); alone, extend() raises at once (_advance)."""
        out = []
        for k, _, why in self.gen.lost:
            e = self.eps[k]
            e.end = "length"
            self.o._write(e, "rejected", why)
            out.append(e)
        self.gen.lost = []
        return out

    def _advance(self, e: _Episode, fut, deadline: float) -> bool:
        """Apply one environment step; True if the episode ended."""
        o, cfg = self.o, self.o.cfg
        try:
            out = o.result(fut, deadline)
            obs, reward, done, *rest = out
            info = rest[0] if rest else {}
            counts, errors = _info(info)
            if isinstance(reward, (str, bytes)) or not math.isfinite(float(reward)):
                e.reward = 0.0  # an error like an exception: the episode scores 0
                raise ValueError(f"the reward {reward!r:.80} is not a finite number")
            e.reward += float(reward)
        except TimeoutError:
            e.end = "timeout"
            o._fail(e, "timeout", f"env.step returned nothing within {o.timeout:.1f} s")
            return True
        except Exception as ex:  # noqa: BLE001 (user code, or a step that returned the wrong shape)
            e.end = "error"
            o._fail(
                e,
                "error",
                f"env.step raised or returned something other than (observation, finite reward, "
                f"done[, info]): {type(ex).__name__}: {ex}",
            )
            return True
        for k, v in counts.items():
            o._counts[k] += v
        for err in errors:
            o._write(
                e,
                err.get("kind", "error"),
                err.get("error", ""),
                **{k: v for k, v in err.items() if k not in ("kind", "error")},
            )
        if done or obs is None:
            e.end = "done"
            return True
        if e.turns >= cfg.env.max_turns:
            e.end = "turns"
            return True
        try:
            turn = render_turn(o.tokenizer, obs, o.vision.placeholder if o.vision else None)
            pictures = o._turn_images(obs)
            expanded = o.expand(turn, pictures)
        except UserError:  # the template itself: every episode would fail the same way
            raise
        except Exception as ex:  # noqa: BLE001 (messages the template cannot render, images that do not load)
            e.end = "error"
            o._fail(e, "error", f"the observation could not be rendered: {type(ex).__name__}: {ex}")
            return True
        if len(e.images) + len(pictures) > cfg.rollout.images_per_prompt:  # vLLM would refuse the request
            e.end = "length"
            o._write(e, "rejected", f"{len(e.images) + len(pictures)} images, more than rollout.images_per_prompt")
            return True
        room = min(o.budget - len(e.ids), cfg.rollout.max_model_len - e.plen - len(e.ids)) - len(expanded)
        if room < 1:  # the observation, and at least one assistant token, would not fit
            e.end = "length"
            return True
        e.ids += expanded
        e.feed += turn
        e.images += pictures
        e.logprobs += [0.0] * len(expanded)  # placeholders: environment tokens carry no loss
        e.mask += [0] * len(expanded)
        o._counts["env/env_tokens"] += len(expanded)
        o._counts["env/images"] += len(pictures)
        try:
            images = tuple(e.images) if o.vision else ()
            self.gen.extend(e.k, 0, e.prompt + e.feed, min(cfg.rollout.max_new_tokens, room), e.turns, images)
        except vllm_compat.REJECTED as ex:
            e.end = "length"
            o._write(e, "rejected", str(ex))
            return True
        return False

    def _sample(self, e: _Episode) -> Sample:
        o = self.o
        o._counts["env/episodes"] += 1
        o._counts["env/turns"] += e.turns
        o._counts["env/truncated_turns"] += e.end == "turns"
        o._counts["env/truncated_length"] += e.end == "length"
        return Sample(
            e.i,
            e.ids,
            e.logprobs,
            e.end == "done",
            e.j,
            loss_mask=e.mask,
            env_reward=e.reward,
            prompt_ids=e.expanded if e.expanded is not None else e.prompt,  # reset's, as vLLM ran it
            images=tuple(e.images) if o.vision else (),
        )
