"""The rollout engine: one vLLM engine per rank, in process (default) or in vLLM's own
engine-core process (`rollout.mode=outofprocess`); or, with rollout.tensor_parallel_size > 1, one
engine per tensor-parallel group of consecutive ranks (launch.TPGroup), in process.

Tensor parallel: vLLM's external launcher runs the engine's scheduler on every rank of the group
and the model's collectives expect the same batch on each, so every call gathers the group's
requests (each rank's own prompts, in member order), every rank queues all of them in that order
and steps its engine the same way, and each rank keeps the outputs of its own prompts. Requests
added while a generation runs (multi-turn episodes' next turns) are queued by their rank and
gathered after the engine step whose results decided them (Generation.extend).

Verbs: `generate`, `greedy`, `prompt_logprobs`, `update_weights`, `wake`, `sleep`
(the verl rollout verb set). It never imports the trainer; `sync.py` joins the two.
Prompts go in and out as token ids: no re-tokenisation, no detokenisation inside vLLM.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from vllm import LLM, SamplingParams

from hybridrl.core import launch, memory
from hybridrl.core.config import Config, ConfigError
from hybridrl.data import images as image_io
from hybridrl.data.batch import Sample
from hybridrl.engines import ipc, lora, vllm_compat

log = logging.getLogger("hybridrl")


@dataclass(frozen=True)
class EngineSizing:
    """What is decided once the trainer is built, measured rather than configured: vLLM's share of
    the device and its KV cache, its sequences at once, whether the trainer's states leave the
    device while vLLM runs (engine_cycle.plan_rollout). Kept beside the resolved config, which
    stays as the run recorded it; the rollout engine and the engine cycle read these."""

    gpu_memory_utilization: str  # a fraction, or 'auto' (CPU: unused)
    kv_cache_mb: int
    max_num_seqs: int  # 0: vLLM's default
    offload_states: str  # on/off once planned; 'auto' as configured offloads

    @classmethod
    def of(cls, cfg: Config) -> "EngineSizing":
        """As configured, nothing measured: the config's own values."""
        r = cfg.rollout
        return cls(r.gpu_memory_utilization, r.kv_cache_mb, r.max_num_seqs, cfg.train.offload_states)


@dataclass
class Generation:
    """Queued requests; iterate for lists of finished Samples (see Rollout.generate)."""

    llm: LLM
    requests: dict[str, tuple[int, int | None]]  # request id -> (prompt index, sample index; None: all n)
    rejected: dict[int, str]  # prompt index -> why vLLM refused it
    params: SamplingParams | None = None  # what generate() was asked for, for extend()
    seed: int | None = None
    tag: str = ""  # this generation's prefix of the request ids
    lora_request: object = None  # LoRA: the policy's adapter, for extend()'s requests too
    tp: launch.TPGroup | None = None  # a tensor-parallel group: extend() queues, the group adds together
    others: set = field(default_factory=set)  # request ids of the group's other ranks: stepped, not kept
    grows: bool = False  # its caller extend()s it (multi-turn): a group gathers after the steps that finish requests
    queued: list = field(default_factory=list)  # this rank's extend()s, not yet gathered
    lost: list = field(default_factory=list)  # (prompt index, sample index, why): own extend()s vLLM refused
    rng: object = None  # a tensor-parallel group's sampling state (vllm_compat.SamplingRNG)
    routes: object = None  # Rollout.routes_of, when the model's routes are recorded
    images: bool = False  # prompts with images: samples carry the prompt as vLLM expanded it

    def extend(self, i: int, j: int, ids: list[int], max_tokens: int, turn: int, images: tuple = ()) -> None:
        """Queue one more request for (prompt i, sample j) while this generation is being iterated:
        a multi-turn episode's next assistant turn, continuing from `ids` (the prefix cache holds
        their KV), which hold one placeholder for each of `images` (the episode's, a vision-language
        model's). Raises vllm_compat.REJECTED if the engine will not serve it."""
        own = self.params.clone()
        own.n, own.max_tokens = 1, max_tokens
        if self.seed is not None:
            own.seed = self.seed + 1_000_003 * turn + i * 1_009 + j
        rid = f"{self.tag}-{i}-{j}-t{turn}"
        if self.tp is not None:  # the group adds every rank's next turns together (_add_queued)
            self.queued.append((rid, ids, own, i, j, images))
            return
        vllm_compat.add_request(self.llm, rid, ids, own, self.lora_request, images)
        self.requests[rid] = (i, j)

    def keep(self, rid: str, at: tuple[int, int | None], mine: bool) -> None:
        """Map a queued request to (prompt index, sample index) if its outputs are this rank's."""
        if mine:
            self.requests[rid] = at
        else:
            self.others.add(rid)

    def abort(self) -> list[tuple[Sample, bool]]:
        """Stop every request still running and return its samples as they stand, each with `done`:
        True for a sample of an n-sample request that had finished before the abort (its request is
        only reported when all n have), False for one cut short. Partial rollouts (data/partial.py)
        keep them for the next step; not in tensor parallel, where every rank of a group would have to
        abort the same requests at the same engine step."""
        if self.tp is not None:
            raise RuntimeError("partial rollouts cannot abort requests under vLLM tensor parallelism")
        out = []
        for rid, got in vllm_compat.abort_keeping_tokens(self.llm, list(self.requests)).items():
            i, j = self.requests.pop(rid)
            for k, ids, lps, reason in got:
                out.append((Sample(i, ids, lps, reason == "stop", k if j is None else j), reason is not None))
        return out

    def _add_queued(self) -> None:
        """Tensor parallel: every rank's extend()s of the last engine step, in member order, on
        every rank's engine. A refusal (the same on every rank) of one of this rank's is listed in
        `lost`, for its caller to end that episode."""
        for m, queued in enumerate(self.tp.gather(self.queued)):
            for rid, ids, params, i, j, images in queued:
                rid = f"m{m}-{rid}"
                try:
                    vllm_compat.add_request(self.llm, rid, ids, params, self.lora_request, images)
                except vllm_compat.REJECTED as e:
                    if m == self.tp.member:
                        self.lost.append((i, j, str(e)))
                    continue
                self.keep(rid, (i, j), m == self.tp.member)
        self.queued = []

    def __iter__(self) -> Iterator[list[Sample]]:
        # a rank's next turns are decided by the outputs of the step that finished them, which every
        # rank of a group sees: the group gathers them after each step that finished a request
        refill = self._add_queued if self.tp is not None and self.grows else None
        for outs in vllm_compat.step_finished(self.llm, refill, self.rng):
            done = []
            for out in outs:
                if out.request_id in self.others:
                    self.others.discard(out.request_id)
                    continue
                i, j = self.requests.pop(out.request_id)
                for c in out.outputs:  # one, or the prompt's n samples (a request with n > 1)
                    ids = list(c.token_ids)
                    lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
                    routes = self.routes(out.prompt_token_ids, ids, c) if self.routes else None
                    done.append(
                        Sample(i, ids, lps, c.finish_reason == "stop", c.index if j is None else j, routes=routes)
                    )
                    if self.images:
                        done[-1].prompt_ids = list(out.prompt_token_ids)  # expanded by vLLM
            yield done


class Rollout:
    # no routes unless __init__ finds a mixture-of-experts model (and for a stand-in built without it)
    capture = None
    record_routes = False
    vision = False  # a vision-language model (__init__): prompts may hold images
    expanded_prompts: list[list[int]] = []  # the last prompt_logprobs call's sequences, as vLLM ran them
    ban: dict[int, float] = {}  # its placeholder tokens' logit bias: no completion samples one (images.ban)

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        *,
        on_cpu: bool,
        eos_token_id: int,
        rank: int,
        local_rank: int = 0,
        tp: launch.TPGroup | None = None,
        sizing: EngineSizing | None = None,
    ):
        r = cfg.rollout
        self.cfg = cfg
        size = sizing or EngineSizing.of(cfg)  # engine_cycle.plan_rollout's, or as configured
        self.tp = tp if tp is not None and tp.size > 1 else None  # None: this rank's engine is its own
        self.eos = eos_token_id
        self.cuda = not on_cpu
        self.sleep_ok = vllm_compat.sleep_supported(on_cpu) and r.sleep_level > 0
        if on_cpu and rank == 0:
            print(
                "note: vLLM sleep mode is not supported on CPU: sleep/wake are no-ops and vLLM keeps its "
                "memory between rollouts",
                flush=True,
            )
        self.out_of_process = r.mode == "outofprocess"
        # LoRA: vLLM serves its base weights plus the adapter each hand-off replaces (lora.py)
        self.adapter = lora.spec(cfg.model) if cfg.model.lora_rank else None
        self.lora_request = None  # set by the first adapter hand-off; before it, adapter == base (B = 0)
        vllm_compat.exact_float32(cuda=self.cuda, dtype=cfg.model.dtype)
        self.moe = self._moe(model_path)  # a mixture of experts: samples carry their routes (routing.py)
        self.ban = {i: image_io.BAN for i in self._placeholders(model_path)}  # the trainer scores with it too
        self.vision = bool(self.ban)  # a vision-language model: prompts may hold images
        if self.vision:
            vllm_compat.images_without_torchvision(on_cpu)
        with (
            memory.vllm_pool(self.cuda),
            vllm_compat.engine_env(out_of_process=self.out_of_process, local_rank=local_rank, cuda=self.cuda),
        ):
            self.llm = LLM(
                model=model_path,
                dtype=cfg.model.dtype,
                # different samples on each data-parallel rank; the ranks of a tensor-parallel group
                # sample together, with the group's seed
                seed=cfg.train.seed + (tp.index if tp is not None else rank),
                enforce_eager=r.enforce_eager,
                max_model_len=r.max_model_len,
                enable_prefix_caching=r.enable_prefix_caching,
                tensor_parallel_size=r.tensor_parallel_size,
                trust_remote_code=cfg.model.trust_remote_code,
                **vllm_compat.engine_kwargs(
                    on_cpu=on_cpu,
                    kv_cache_bytes=size.kv_cache_mb << 20,
                    gpu_memory_utilization=memory.utilization(size.gpu_memory_utilization),
                    sleep_mode=r.sleep_level > 0,
                    out_of_process=self.out_of_process,
                    lora_rank=cfg.model.lora_rank,
                    max_num_seqs=size.max_num_seqs,
                    enforce_eager=r.enforce_eager,
                    tensor_parallel_size=r.tensor_parallel_size,
                ),
                **(vllm_compat.route_kwargs(on_cpu) if self.moe else {}),
                **(vllm_compat.image_kwargs(r.images_per_prompt) if self.vision else {}),
            )
        self.sender = ipc.BucketSender(cfg.train.sync_bucket_mb << 20, cuda=self.cuda) if self.out_of_process else None
        self.digest = False  # tests: the out-of-process receiver returns a sha256 of every tensor it rebuilt
        self.last_receipt: dict | None = None  # what the out-of-process receiver reported of the last hand-off
        self.asleep = False  # vLLM's memory is released (weights and KV cache)
        self.weights_lost = False  # a level-2 sleep discarded the weights: only a full hand-off brings them back
        self._calls = 0  # generate() calls, for unique request ids
        self.capture = None  # MoE on CPU: the routes recorded from vLLM's routers (vllm_compat.RouteCapture)
        self.record_routes = self._record_routes(on_cpu)

    # --- routing replay (MoE) -------------------------------------------------------------------
    def _moe(self, model_path: str) -> bool:
        from transformers import AutoConfig

        from hybridrl.engines import routing

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=self.cfg.model.trust_remote_code)
        return routing.wanted(self.cfg, config)[0]

    def _placeholders(self, model_path: str) -> list[int]:
        """A vision-language model's image and video placeholder ids; [] for a text model."""
        from transformers import AutoConfig

        return image_io.placeholders(
            AutoConfig.from_pretrained(model_path, trust_remote_code=self.cfg.model.trust_remote_code)
        )

    def _record_routes(self, on_cpu: bool) -> bool:
        """Whether samples carry their routes: a MoE model, and vLLM returns them (native_routes) or this
        in-process engine records them (RouteCapture). Out of process on CPU they stay in vLLM's process."""
        if not self.moe:
            return False
        if vllm_compat.native_routes(on_cpu):
            return True
        if self.out_of_process:
            log.warning(
                "routing replay: not with rollout.mode=outofprocess on CPU (vLLM's routes stay in its "
                "process); the trainer routes every token itself"
            )
            return False
        self.capture = vllm_compat.RouteCapture(self.llm)
        return True

    def routes_of(self, prompt: list[int], completion: list[int], output) -> torch.Tensor | None:
        """[len(prompt) + len(completion), layers, k] int16: the experts vLLM routed each token to."""
        if self.capture is None:
            return vllm_compat.native_routes_of(output, len(prompt), len(prompt) + len(completion))
        return self.capture.take(prompt, completion)

    # --- generation ---------------------------------------------------------------------------
    def _group(self, prompts: list[list[int]]):
        """Tensor parallel: the group's prompts (every rank's, in member order), how many each rank
        brought, and the group's sampling state; alone: `prompts`, [len(prompts)], None."""
        if self.tp is None:
            return prompts, [len(prompts)], None
        per = self.tp.gather((prompts, vllm_compat.SamplingRNG.draw()))
        return (
            [p for ps, _ in per for p in ps],
            [len(ps) for ps, _ in per],
            vllm_compat.SamplingRNG(per[0][1], self.cuda),
        )

    def _run(self, prompts: list[list[int]], params: SamplingParams, images: list[tuple] | None = None):
        """vLLM's outputs for `prompts` (one call of LLM.generate, the group's in tensor parallel),
        with each prompt's `images` if given."""
        if images is None and self.vision:  # a group's ranks ask alike, with images or not
            images = [()] * len(prompts)
        if images is not None:
            prompts = list(zip(prompts, images))  # type: ignore[arg-type]
        every, counts, rng = self._group(prompts)
        if not every:  # the whole group has nothing to ask (every rank knows it)
            return []
        asked = [vllm_compat.prompt_of(*p) if images is not None else vllm_compat.prompt_of(p) for p in every]
        with rng.active() if rng is not None else nullcontext():
            outs = self.llm.generate(asked, params, use_tqdm=False, lora_request=self.lora_request)
        return outs[launch.own_slice(counts, self.tp.member)] if self.tp else outs

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int | None = None,
        images: list[tuple] | None = None,
    ) -> "Generation":
        """n samples per prompt, with the sampled tokens' log-probs, streamed as they finish.

        Requests are queued now; iterating the returned Generation steps vLLM's engine and
        yields, after each engine step, the samples that finished in it, so a caller can score
        them while the rest are still generating. A prompt is one request for its n samples:
        vLLM processes its input once and fans it out into n sequences, so a prompt's samples
        finish together (one request per sample, as before, processed the same input n times: at
        the demo's size a large share of its generate phase, docs/speed.md). The prefix
        cache shares the prompt's KV. A prompt the engine rejects (longer than max_model_len, a
        token outside the vocabulary) is left out, logged, and listed in `Generation.rejected`.
        A `seed` gives each sample its own request and generator (seed, seed + 1, ...), leaving
        the engine's sampling stream as it was. `images`: each prompt's images (a vision-language
        model's; the prompt holds one placeholder per image, which vLLM expands)."""
        params = SamplingParams(
            n=n if seed is None else 1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,
            stop_token_ids=[self.eos],
            logit_bias=self.ban or None,
            **self._stop(),
        )
        self._calls += 1
        gen = Generation(
            self.llm,
            {},
            {},
            params,
            seed,
            str(self._calls),
            self.lora_request,
            self.tp,
            routes=self.routes_of if self.record_routes else None,
            images=images is not None or self.vision,
        )
        if self.capture is not None:  # the last generation's samples have taken theirs
            self.capture.reset()
        # tensor parallel: every rank's prompts with its own settings (an episode's room differs by rank),
        # and the group's sampling state from its first member's draw (vllm_compat.SamplingRNG)
        pictures = images or [()] * len(prompts)
        per = (
            self.tp.gather((prompts, params, seed, vllm_compat.SamplingRNG.draw(), pictures))
            if self.tp
            else [(prompts, params, seed, None, pictures)]
        )
        if self.tp:
            gen.rng = vllm_compat.SamplingRNG(per[0][3], self.cuda)
        for m, (some, params, seed, _, pictures) in enumerate(per):
            mine = self.tp is None or m == self.tp.member
            tag = f"{self._calls}" if self.tp is None else f"{self._calls}-m{m}"  # a group's ranks reuse indices
            for i, ids in enumerate(some):
                try:
                    if seed is None:
                        rid = f"{tag}-{i}"
                        vllm_compat.add_request(self.llm, rid, ids, params, self.lora_request, pictures[i])
                        gen.keep(rid, (i, None), mine)
                        continue
                    for j in range(n):  # with a seed: one request per sample, each with its own seed
                        rid = f"{tag}-{i}-{j}"
                        own = params.clone()
                        own.seed = seed + i * n + j  # the rank's own prompt index: as with its own engine
                        vllm_compat.add_request(self.llm, rid, ids, own, self.lora_request, pictures[i])
                        gen.keep(rid, (i, j), mine)
                except vllm_compat.REJECTED as e:  # only the first sample can be refused: the rest are the same
                    if mine:
                        gen.rejected[i] = str(e)
                        log.warning("vLLM rejected prompt %d of this batch (%d tokens), dropped: %s", i, len(ids), e)
        return gen

    def generate_partial(
        self,
        prompts: list[list[int]],
        n: int,
        carried: list[tuple[int, int, list[int], int]],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
    ) -> "Generation":
        """generate() for partial rollouts: n samples of each of `prompts`, and before them (vLLM serves
        requests first come, first served) the continuations `carried`, each (prompt index, sample
        index, prompt + the tokens generated so far, tokens left): one request per sample, its prefix
        re-fed as prompt (the prefix cache computes it once per group's prompt). A continuation's
        prompt index is one past `prompts` (the caller's numbering). `Generation.abort` stops the rest."""
        if self.tp is not None:
            raise RuntimeError("partial rollouts run one engine per rank (rollout.tensor_parallel_size 1)")
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,
            stop_token_ids=[self.eos],
            logit_bias=self.ban or None,
            **self._stop(),
        )
        self._calls += 1
        gen = Generation(self.llm, {}, {}, params, None, str(self._calls), self.lora_request, None)
        for i, j, ids, left in carried:
            gen.extend(i, j, ids, left, turn=0)  # no REJECTED: its prompt and tokens fit max_model_len before
        for i, ids in enumerate(prompts):
            rid = f"{self._calls}-{i}"
            try:
                vllm_compat.add_request(self.llm, rid, ids, params, self.lora_request)
            except vllm_compat.REJECTED as e:
                gen.rejected[i] = str(e)
                log.warning("vLLM rejected prompt %d of this batch (%d tokens), dropped: %s", i, len(ids), e)
                continue
            gen.requests[rid] = (i, None)
        return gen

    def requests_held(self) -> int:
        """Requests vLLM's output processor still holds: 0 between generations unless aborted ones leak."""
        return vllm_compat.requests_held(self.llm)

    def _stop(self) -> dict:
        """rollout.stop: vLLM matches stop strings on the detokenised text, so only then does it
        detokenise. The completion's tokens run to the one that completed the stop string (its
        text is kept, as an EOS token is): what vLLM sampled is what the trainer scores."""
        stop = [str(s) for s in self.cfg.rollout.stop]
        return dict(stop=stop, include_stop_str_in_output=True, detokenize=True) if stop else dict(detokenize=False)

    def greedy(self, prompts: list[list[int]], max_tokens: int, images: list[tuple] | None = None) -> list[list[int]]:
        """Greedy completions (a tensor-parallel group's ranks call it together, with or without prompts),
        with each prompt's `images` if given."""
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            stop_token_ids=[self.eos],
            logit_bias=self.ban or None,
            **self._stop(),
        )
        return [list(o.outputs[0].token_ids) for o in self._run(prompts, params, images)]

    def prompt_logprobs(self, seqs: list[list[int]], images: list[tuple] | None = None) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1, as vLLM computes it (temperature 1). With `images`
        (each sequence's, holding one placeholder per image), over the sequence as vLLM expanded it
        (`expanded_prompts` of the same call)."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        try:
            outs = self._run(seqs, params, images)
        except vllm_compat.REJECTED as e:  # the probe's or a caller's sequences: a setting, not a crash
            longest = max(map(len, seqs), default=0)
            raise ConfigError(
                f"vLLM refused to score a {longest}-token sequence at rollout.max_model_len "
                f"{self.cfg.rollout.max_model_len} ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
                f"raise --rollout.max_model_len to at least {longest + 1}"
            ) from None
        self.expanded_prompts = [list(o.prompt_token_ids) for o in outs]
        return [
            [d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(self.expanded_prompts, outs)
        ]

    # --- weights and memory -------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load every parameter anew (in process: tensors by reference, no serialisation; out of
        process: through the staging buckets), then drop the prefix cache: its KV entries were
        computed by the old weights (and a vision-language model's encoder cache: its tower's features).
        Always the full set, so it also restores a level-2 sleep.
        LoRA: the tensors are the adapter, which replaces the previous one (the base weights stay;
        a level-2 sleep, which discards them, is not used with LoRA: recipe.resolve)."""
        if self.sender is not None:
            self.last_receipt = self.sender.send(
                named_tensors,
                lambda address, **kw: vllm_compat.receive_weights(self.llm, address, adapter=self.adapter, **kw),
                digest=self.digest,
            )
        elif self.adapter:
            vllm_compat.load_adapter(self.llm, named_tensors, self.adapter)
        else:
            vllm_compat.load_weights(self.llm, named_tensors)
        self.llm.reset_prefix_cache()
        if self.vision:  # a trained tower's features changed (model.train_vision); a frozen one's are recomputed
            vllm_compat.reset_encoder_cache(self.llm)
        if self.adapter:
            self.lora_request = vllm_compat.lora_request()
        else:
            self.weights_lost = False

    def wake(self, tags: list[str]) -> None:
        """Give vLLM its memory back: ["weights"] before the hand-off, ["kv_cache"] after it. The
        KV cache never wakes over discarded weights: a level-2 sleep must be followed by a hand-off."""
        if "kv_cache" in tags and self.weights_lost:
            raise RuntimeError(
                "vLLM's weights were discarded by a level-2 sleep and not handed off again: "
                "wake(['weights']), hand off, then wake(['kv_cache'])"
            )
        if self.sleep_ok and self.asleep:
            with memory.vllm_pool(self.cuda):
                self.llm.wake_up(tags=tags)
            self.asleep = "kv_cache" not in tags

    def sleep(self, level: int) -> None:
        """Release vLLM's memory: level 1 keeps the weights in CPU memory, level 2 discards them."""
        if self.sleep_ok:
            with memory.vllm_pool(self.cuda):
                self.llm.sleep(level=level)
            self.asleep = True
            self.weights_lost = level == 2

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        vllm_compat.shutdown(self.llm)
        del self.llm
