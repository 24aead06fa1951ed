"""The rollout engine: one in-process vLLM engine per rank.

Verbs: `generate`, `greedy`, `prompt_logprobs`, `update_weights`, `wake`, `sleep`
(the verl rollout verb set). It never imports the trainer; `sync.py` joins the two.
Prompts go in and out as token ids: no re-tokenisation, no detokenisation inside vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from vllm import LLM, SamplingParams

from . import vllm_compat
from .config import Config

log = logging.getLogger("hybridrl")


@dataclass
class Sample:
    prompt_idx: int  # index into the prompt list passed to generate
    token_ids: list[int]  # completion tokens
    logprobs: list[float]  # vLLM's log-prob of each completion token (after temperature)
    finished: bool  # stopped on EOS / stop token rather than on the length limit
    sample_idx: int = 0  # which of the prompt's n samples


@dataclass
class Generation:
    """Queued requests; iterate for lists of finished Samples (see Rollout.generate)."""
    llm: LLM
    requests: dict[str, tuple[int, int]]  # request id -> (prompt index, sample index)
    rejected: dict[int, str]  # prompt index -> why vLLM refused it

    def __iter__(self) -> Iterator[list[Sample]]:
        for outs in vllm_compat.step_finished(self.llm):
            done = []
            for out in outs:
                i, j = self.requests.pop(out.request_id)
                c = out.outputs[0]
                ids = list(c.token_ids)
                lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
                done.append(Sample(i, ids, lps, c.finish_reason == "stop", j))
            yield done


class Rollout:
    def __init__(self, cfg: Config, model_path: str, *, on_cpu: bool, eos_token_id: int, rank: int):
        r = cfg.rollout
        self.cfg = cfg
        self.eos = eos_token_id
        self.sleep_ok = vllm_compat.sleep_supported(on_cpu)
        if not self.sleep_ok and rank == 0:
            log.info("vLLM sleep mode is not supported on CPU: sleep/wake are no-ops here")
        self.llm = LLM(
            model=model_path,
            dtype=cfg.model.dtype,
            seed=cfg.train.seed + rank,  # different samples on each data-parallel rank
            enforce_eager=r.enforce_eager,
            max_model_len=r.max_model_len,
            enable_prefix_caching=r.enable_prefix_caching,
            tensor_parallel_size=r.tensor_parallel_size,
            distributed_executor_backend="external_launcher",  # this process is the worker
            trust_remote_code=cfg.model.trust_remote_code,
            **vllm_compat.engine_kwargs(on_cpu=on_cpu, kv_cache_bytes=r.kv_cache_mb << 20,
                                        gpu_memory_utilization=r.gpu_memory_utilization),
        )
        self._asleep = False
        self._calls = 0  # generate() calls, for unique request ids

    # --- generation ---------------------------------------------------------------------------
    def _run(self, prompts: list[list[int]], params: SamplingParams):
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float,
                 max_tokens: int) -> "Generation":
        """n samples per prompt, with the sampled tokens' log-probs, streamed as they finish.

        Requests are queued now; iterating the returned Generation steps vLLM's engine and
        yields, after each engine step, the samples that finished in it, so a caller can score
        them while the rest are still generating. Each sample is its own request (vLLM fans
        n > 1 out into n requests the same way); the prefix cache shares the prompt's KV. A
        prompt the engine rejects (longer than max_model_len, a token outside the vocabulary)
        is left out, logged, and listed in `Generation.rejected`."""
        params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                logprobs=0, stop_token_ids=[self.eos], detokenize=False)
        self._calls += 1
        gen = Generation(self.llm, {}, {})
        for i, ids in enumerate(prompts):
            try:
                for j in range(n):
                    rid = f"{self._calls}-{i}-{j}"
                    vllm_compat.add_request(self.llm, rid, ids, params)
                    gen.requests[rid] = (i, j)
            except vllm_compat.REJECTED as e:  # only the first sample can be refused: the rest are the same
                gen.rejected[i] = str(e)
                log.warning("vLLM rejected prompt %d of this batch (%d tokens), dropped: %s", i, len(ids), e)
        return gen

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[self.eos],
                                detokenize=False)
        return [list(o.outputs[0].token_ids) for o in self._run(prompts, params)]

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1, as vLLM computes it (temperature 1)."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self._run(seqs, params)
        return [[d[t].logprob for t, d in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(seqs, outs)]

    # --- weights and memory -------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place (tensors by reference, no serialisation), then drop the
        prefix cache: its KV entries were computed by the old weights."""
        vllm_compat.load_weights(self.llm, named_tensors)
        self.llm.reset_prefix_cache()

    def wake(self, tags: list[str]) -> None:
        if self.sleep_ok and self._asleep:
            self.llm.wake_up(tags=tags)
            self._asleep = "kv_cache" not in tags

    def sleep(self, level: int) -> None:
        if self.sleep_ok:
            self.llm.sleep(level=level)
            self._asleep = True

    def close(self) -> None:
        del self.llm
        vllm_compat.shutdown()
