"""A neural reward model: a sequence-classification model that scores prompt + completion, one
term of `reward.fn` written `rm:PATH[:WEIGHT]` (e.g. `arithmetic:1.0,rm:/models/my-rm:0.5`).

Verb: `score(prompts, completions) -> list[float]`, the collector's `reward_model` phase, run
once per generation round on all of its samples, after the rule-based terms. The model is
Hugging Face's `AutoModelForSequenceClassification` with one output (`num_labels=1`); the score is
its logit, which transformers pools at the last non-padding token. Texts are scored in batches of
`reward.rm_batch_size`, right-padded, on the device.

Memory: like the reference under ZeRO-2 (reference.py), its weights live in host memory (pinned
on a GPU) and are copied to the device for the phase only, then dropped; nothing is copied back.
On CPU the moves are no-ops. The phase runs before vLLM sleeps (dynamic sampling needs the
rewards to decide on another round), so on a GPU the copy must fit beside vLLM: the memory plan
keeps its bytes free on top of `rollout.memory_margin_mb` (`load_all` runs before the plan), and its
activations come out of that margin.

Departures: the RM re-tokenizes the text with its own tokenizer (an RM usually has another
vocabulary than the policy, so the policy's token ids are not reused); the text is the user's
prompt and the completion in the RM tokenizer's chat template when it has one (as a chat RM was
trained), else the prompt followed by the completion. The held-out evaluation counts the
rule-based terms only (accuracy is `reward >= 1` of the verifier).
"""

from __future__ import annotations

from itertools import chain

import torch

from hybridrl.core.config import Config, ConfigError, torch_dtype
from hybridrl.data.rewards import model_terms


class RewardModel:
    def __init__(
        self, path: str, *, device: torch.device, dtype: torch.dtype, batch_size: int, trust_remote_code: bool = False
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code
            )
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"reward term rm:{path}: cannot load a sequence-classification model and its tokenizer "
                f"({first}); give a Hugging Face model directory or hub name"
            ) from None
        if self.model.config.num_labels != 1:
            raise ConfigError(
                f"reward term rm:{path} has num_labels={self.model.config.num_labels}; a reward model "
                "has one output (num_labels=1)"
            )
        tok = self.tokenizer
        if tok.pad_token is None:  # batches are padded; transformers pools at the last non-pad token
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = tok.pad_token_id
        self.model.eval().requires_grad_(False)
        self.path, self.device, self.batch_size = path, device, batch_size
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        self.chat = bool(getattr(tok, "chat_template", None))  # the template brings its special tokens
        cuda = device.type == "cuda"
        self._host = [
            (t, t.data.pin_memory() if cuda else t.data) for t in chain(self.model.parameters(), self.model.buffers())
        ]

    @property
    def nbytes(self) -> int:
        """Device bytes of its weights and buffers while it scores (the memory plan counts them)."""
        return sum(host.numel() * host.element_size() for _, host in self._host)

    def text(self, prompt: str, completion: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False
            )
        return prompt + completion

    def _place(self, device: torch.device) -> None:
        for t, host in self._host:
            t.data = host if device.type == "cpu" else host.to(device, non_blocking=True)

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One score per (prompt, completion): the model's logit, as a float."""
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        self._place(self.device)
        try:
            out = []
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=self.max_len is not None,
                    max_length=self.max_len,
                    add_special_tokens=not self.chat,
                ).to(self.device)
                out += self.model(**enc).logits[:, 0].float().cpu().tolist()  # [b]
            return out
        finally:
            self._place(torch.device("cpu"))


def load_all(cfg: Config, device: torch.device) -> list[tuple[str, float, RewardModel]]:
    """The `rm:PATH[:WEIGHT]` terms of reward.fn as (name, weight, model), loaded into host memory;
    built before vLLM is planned, so that the plan keeps room for them (engine_cycle.plan_rollout)."""
    return [
        (
            f"rm:{path}",
            weight,
            RewardModel(
                path,
                device=device,
                dtype=torch_dtype(cfg.model.dtype),
                batch_size=cfg.reward.rm_batch_size,
                trust_remote_code=cfg.model.trust_remote_code,
            ),
        )
        for path, weight in model_terms(cfg.reward.fn)
    ]
