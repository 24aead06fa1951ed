"""The shared-prompt layout (train.share_prompt) gives the padded layout's log-probs, loss and gradients.

Three groups of rows share three prompts of different lengths (as rollout.n samples of a prompt do),
with completions of different lengths; the trainer's own `_forward` and `logprobs` run on a tiny
Qwen2 through its `TokenLogprobs` module (no DeepSpeed in between), once with every row whole and
once with each prompt computed once and its KV cache gathered to its rows. A completion that could
not see its prompt, or saw the wrong one (a mis-gathered cache), or a pad slot, would be off by far
more than float32's tolerance: the test checks that too by scrambling the group index.
"""

import pytest
import torch

from hybridrl.core.config import Config
from hybridrl.data.batch import Batch, shared_micro_batches
from hybridrl.engines.policy import TokenLogprobs
from hybridrl.engines.trainer import Trainer

from helpers.packing import V, assert_same_loss_and_grads, loss_and_grads, tiny_model

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def rows() -> Batch:
    """3 prompts (5, 2 and 4 tokens) x 3, 2 and 3 samples; completions of 1..6 tokens."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 2, 4)]
    src = [0, 0, 0, 1, 1, 2, 2, 2]
    completions = [torch.randint(1, V, (n,), generator=g).tolist() for n in (3, 6, 1, 4, 2, 5, 5, 2)]
    logp_rollout = [(-0.1 * torch.arange(1, len(c) + 1)).tolist() for c in completions]
    adv = [1.0, -0.5, 0.7, -1.2, 0.3, 0.9, -0.1, -0.6]
    return Batch.from_rows([prompts[i] for i in src], completions, logp_rollout, adv)


def trainer(share: bool, attn: str = "sdpa") -> Trainer:
    t = Trainer.__new__(Trainer)
    t.cfg, t.device, t.packing, t.share_prompt = Config(), torch.device("cpu"), False, share
    model = tiny_model()
    model.config._attn_implementation = attn
    t.engine = TokenLogprobs(model, "torch", chunk=7, max_len=6)
    return t


def test_shared_layout():
    b = Batch.from_rows(
        [[1, 5, 6], [1, 5, 6], [7]], [[8, 2], [9], [3, 3, 2]], [[-0.1, -0.2], [-1], [0, 0, 0]], [1.0, -1.0, 0.5]
    )
    s = b.shared()
    assert s.prompts.tolist() == [[1, 5, 6], [7, 0, 0]] and s.prompt_lens.tolist() == [3, 1]
    assert s.group.tolist() == [0, 0, 1]
    assert s.completions.tolist() == [[8, 2, 0], [9, 0, 0], [3, 3, 2]]
    assert s.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 1]]
    assert s.position_ids.tolist() == [[3, 4, 5], [3, 4, 5], [1, 2, 3]]
    # the loss tokens in the padded layout's order
    assert s.completions[s.loss_mask].tolist() == b.tokens[b.loss_mask].tolist() == [8, 2, 9, 3, 3, 2]
    assert Batch.from_rows([[1]], [[2]], [[0.0]], [0.0]).shared() is not None
    no_loss = Batch.from_rows([[1, 2], [1, 2]], [[], [3]], [[], [0.0]], [0.0, 0.0])
    assert no_loss.shared() is None  # a row without a loss token: the padded layout is used


def test_shared_micro_batches_keep_groups_together():
    b = rows()  # groups [0, 1, 2], [3, 4], [5, 6, 7]; prompts 5, 2, 4; completions 3, 6, 1, 4, 2, 5, 5, 2
    assert [g.tolist() for g in shared_micro_batches(b, 1000)] == [list(range(8))]
    # 25 tokens: [0, 1, 2] = 5 + 3 x 6 = 23; adding row 3 (a second prompt) = 2 x 5 + 4 x 6 = 34
    assert [g.tolist() for g in shared_micro_batches(b, 25)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [g.tolist() for g in shared_micro_batches(b, 8)] == [[0], [1], [2], [3], [4], [5], [6], [7]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_logprobs_equal_padded(attn):
    batch = rows()
    padded, shared = trainer(False, attn).logprobs(batch, 0.7), trainer(True, attn).logprobs(batch, 0.7)
    assert shared.shape == batch.tokens.shape and bool((shared[~batch.loss_mask] == 0).all())
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-5)
    assert float(padded[batch.loss_mask].abs().min()) > 0


def test_shared_layout_is_checked_by_the_logprobs():
    """A completion gathered to another row's prompt is far off: the equality above is not vacuous."""
    batch = rows()
    t = trainer(True)
    s = batch.shared()
    wrong = s._replace(group=s.group.roll(1))
    right = t.engine(None, None, None, 1.0, shared=s._asdict())[0]
    off = t.engine(None, None, None, 1.0, shared=wrong._asdict())[0]
    assert float((right - off).abs().max()) > 0.1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tis_level", [None, "sequence"])
def test_shared_loss_and_gradients_equal_padded(attn, tis_level):
    batch = rows()
    batch.logp_old = trainer(False, attn).logprobs(batch, 1.0) + 0.05 * batch.loss_mask
    assert_same_loss_and_grads(
        *(loss_and_grads(trainer(share, attn), batch, tis_level, "token_mean") for share in (False, True))
    )
