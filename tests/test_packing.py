"""Packed micro-batches (train.packing) give the padded layout's log-probs, loss and gradients.

The trainer's own `_forward` and `logprobs` run on a tiny Qwen2 (sdpa, float32) through its
`TokenLogprobs` module, with no DeepSpeed in between, once packed and once padded. Rows have
different lengths, so the padded layout computes padding and the packed one does not; a packed
row whose samples attended to each other (e.g. transformers not seeing the packing because a KV
cache was passed) is off by ~1 nat, far outside float32 tolerance.
"""

import pytest
import torch

from hybridrl.data.batch import Batch, micro_batches

from helpers.packing import assert_same_loss_and_grads, loss_and_grads, rows, trainer

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def test_packed_layout():
    b = Batch.from_rows([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], [[-0.1, -0.2], [-1, -2, -3]], [1.0, -1.0])
    p = b.packed()
    assert p.tokens.tolist() == [[1, 5, 6, 8, 2, 1, 7, 9, 9, 2]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    assert p.seq_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]]
    assert p.tokens[p.loss_mask].tolist() == b.tokens[b.loss_mask].tolist() == [8, 2, 9, 9, 2]
    ragged = b.select(torch.tensor([1, 0]))  # row 0 is padded by one: the padding is dropped
    assert ragged.select(torch.tensor([1])).packed().tokens.tolist() == [[1, 5, 6, 8, 2]]
    short = Batch.from_rows([[1], [1, 7, 7]], [[4], [5]], [[0.0], [0.0]], [0.0, 0.0])
    assert short.packed().position_ids.tolist() == [[0, 1, 0, 1, 2, 3]]


def test_packed_micro_batches_count_real_tokens():
    lengths = torch.tensor([10, 3, 7, 7, 2, 9])
    groups = micro_batches(lengths, 20, packed=True)
    # longest first: [10, 9] = 19, then [7, 7, 3, 2] = 19 (padded, 7 * 4 = 28 would not fit)
    assert [g.tolist() for g in groups] == [[0, 5], [2, 3, 1, 4]]
    assert [g.tolist() for g in micro_batches(lengths, 20)] == [[0, 5], [2, 3], [1, 4]]


def test_packed_logprobs_equal_padded():
    batch = rows()
    padded, packed = trainer(False).logprobs(batch, 0.7), trainer(True).logprobs(batch, 0.7)  # [B, T]
    assert packed.shape == batch.tokens.shape and bool((packed[~batch.loss_mask] == 0).all())
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert float(padded[batch.loss_mask].abs().min()) > 0  # every completion token was scored


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("tis_level", [None, "token", "sequence"])
def test_packed_loss_and_gradients_equal_padded(agg, tis_level):
    batch = rows()
    batch.logp_old = trainer(False).logprobs(batch, 1.0) + 0.05 * batch.loss_mask  # off-policy: ratio 0.95
    assert_same_loss_and_grads(*(loss_and_grads(trainer(packing), batch, tis_level, agg) for packing in (False, True)))
