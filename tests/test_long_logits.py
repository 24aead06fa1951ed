"""No path builds the full [tokens, vocab] logits of a long sequence (issue 49).

At 16k tokens and Qwen's 152k vocabulary the full logits are 9 GiB in float32 per sequence: every
pass that scores completion tokens must go through the chunked log-prob path (kernels/logprob.py,
at most train.logprob_chunk rows of logits at once). One 16384-token sequence goes through each
such pass with the real engines, on CPU: the old log-probs and the update (the trainer, DeepSpeed),
the reference, the critic's values (a one-output head) and a reward model's score (a
sequence-classification head). A dispatch mode sees every tensor each op returns and keeps the
most rows any [rows, vocab] tensor had: a pass that materialised the logits shows 16k rows.
Evaluation and the probe score with vLLM, which computes logits for the sampled positions only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridrl.core import config

sys.path.insert(0, str(Path(__file__).parent))
import tiny_model  # noqa: E402

TOKENS = 16384
CHUNK = 1024  # train.logprob_chunk's default


class WidestLogits(TorchDispatchMode):
    """The most rows of any tensor whose last dimension is the vocabulary, over every op run inside."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model.build(tmp_path_factory.mktemp("long") / "m", hidden=32, layers=1, max_positions=TOKENS + 64)


def long_batch(vocab: int):
    from hybridrl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (64,), generator=g).tolist()
    completion = torch.randint(3, vocab, (TOKENS - 64,), generator=g).tolist()
    batch = Batch.from_rows([prompt], [completion], [[-1.0] * len(completion)], [1.0])
    batch.logp_old = None
    return batch


def long_config(**over):
    return config.load(
        None,
        {
            "model.dtype": "float32",
            "train.max_tokens_per_micro_batch": TOKENS,
            "rollout.max_new_tokens": TOKENS - 64,
            "data.max_prompt_len": 64,
            "rollout.max_model_len": TOKENS,
            "train.lr": 1e-6,
            "train.share_prompt": "off",
            **over,
        },
    )


def widest(vocab: int, fn) -> int:
    with WidestLogits(vocab) as mode:
        fn()
    return mode.rows


def test_the_scoring_modules_never_hold_the_logits_of_a_16k_token_sequence(model):
    """The modules every scoring pass runs, without the engines around them: the policy's
    TokenLogprobs (the trainer's old log-probs and update, the reference: forward, and the fused
    loss's backward) and the critic's value model."""
    from transformers import AutoModel, AutoModelForCausalLM

    from hybridrl.engines.critic import _ValueModel
    from hybridrl.engines.policy import TokenLogprobs

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    vocab = hf.config.vocab_size
    batch = long_batch(vocab)
    tokens, mask = batch.tokens, batch.attention_mask()
    module = TokenLogprobs(hf, "torch", CHUNK)
    with torch.no_grad():
        assert 0 < widest(vocab, lambda: module(tokens, mask, batch.loss_mask, 1.0)) <= CHUNK
    n = int(batch.loss_mask[:, 1:].sum())
    loss = dict(
        logp_old=None,
        advantages=torch.ones(n),
        mask=torch.ones(n),
        logp_ref=None,
        logp_rollout=None,
        seq_ids=torch.zeros(n, dtype=torch.long),
    )  # on-policy, as the trainer's first update

    def update():
        module(tokens, mask, batch.loss_mask, 1.0, loss=loss)[0].backward()

    assert 0 < widest(vocab, update) <= CHUNK
    critic = _ValueModel(AutoModel.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa"))
    with torch.no_grad():
        assert widest(vocab, lambda: critic(tokens, mask, batch.loss_mask)) == 0  # a one-output head


@pytest.mark.slow  # the real engines at 16k tokens: minutes on a loaded 2-core machine
def test_no_pass_materialises_the_logits_of_a_16k_token_sequence(model, world_of_one):
    from transformers import AutoConfig

    from hybridrl.engines.critic import Critic
    from hybridrl.engines.reference import Reference
    from hybridrl.engines.trainer import Trainer

    vocab = AutoConfig.from_pretrained(model).vocab_size
    batch = long_batch(vocab)
    cfg = long_config()
    cpu = torch.device("cpu")
    rows = {}
    trainer = Trainer(cfg, str(model), device=cpu, dtype=torch.float32, attn_implementation="sdpa")
    rows["old log-probs"] = widest(vocab, lambda: trainer.logprobs(batch, temperature=1.0))
    rows["update"] = widest(vocab, lambda: trainer.step(batch))
    reference = Reference(
        long_config(**{"algo.kl_coef": 0.01}), str(model), device=cpu, dtype=torch.float32, attn_implementation="sdpa"
    )
    rows["reference"] = widest(vocab, lambda: reference.logprobs(batch, temperature=1.0))
    critic = Critic(
        long_config(**{"algo.advantage": "gae"}),
        str(model),
        device=cpu,
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    rows["critic"] = widest(vocab, lambda: critic.values(batch))
    assert all(0 < r <= CHUNK for k, r in rows.items() if k != "critic"), rows  # the passes did score, by chunks
    assert rows["critic"] == 0, rows  # a one-output head: no vocabulary-wide tensor at all


def test_a_reward_model_scores_a_16k_token_answer_without_vocabulary_logits(model, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hybridrl.engines.reward_model import RewardModel

    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(model, num_labels=1).save_pretrained(rm)
    AutoTokenizer.from_pretrained(model).save_pretrained(rm)
    scorer = RewardModel(str(rm), device=torch.device("cpu"), dtype=torch.float32, batch_size=1)
    answer = "!" * (TOKENS - 64)  # '!' is one token (tiny_model's corpus never merges it)
    vocab = scorer.model.config.vocab_size
    scores = []
    assert widest(vocab, lambda: scores.extend(scorer.score(["what is 1+1?"], [answer]))) == 0
    assert len(scores) == 1 and scores[0] == scores[0]  # a finite score of the whole answer


def test_gradient_checkpointing_recomputes_every_layer_in_the_update(model, world_of_one):
    """model.gradient_checkpointing keeps each layer's input and recomputes the layer in backward. The
    trainer's model runs in eval mode (no dropout), and transformers checkpoints only in training mode:
    the knob did nothing, every layer's activations stayed (bench.plan_check: 1.5x the plan at one
    4096-token sequence). Now an update runs each layer twice (the forward, and its recomputation in
    backward), the no-grad log-probs once, and dropout stays off."""
    from hybridrl.data.batch import Batch
    from hybridrl.engines.trainer import Trainer

    cfg = long_config(**{"model.gradient_checkpointing": True, "train.minibatches": 1})
    trainer = Trainer(cfg, str(model), device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    batch = Batch.from_rows([[5, 6, 7]], [[8, 9, 10, 11]], [[-1.0] * 4], [1.0])
    batch.logp_old = None
    mlp, runs = trainer.hf.model.layers[0].mlp, []
    forward = type(mlp).forward
    # a patched forward, not a hook: torch's checkpoint runs the recomputation without the module's hooks
    mlp.forward = lambda *a, **kw: (runs.append(torch.is_grad_enabled()), forward(mlp, *a, **kw))[1]
    trainer.logprobs(batch, 1.0)
    assert runs == [False]
    runs.clear()
    trainer.step(batch)
    assert len(runs) == 2, runs  # the checkpointed forward, then its recomputation for backward
    assert not any(m.training for m in trainer.hf.modules() if isinstance(m, torch.nn.Dropout))
