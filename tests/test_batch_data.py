import pytest
import torch

from hybridrl.data import prompts
from hybridrl.data.batch import Batch, micro_batches

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def test_batch_layout():
    b = Batch.from_rows([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], [[-0.1, -0.2], [-1, -2, -3]], [1.0, -1.0])
    assert b.tokens.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert b.loss_mask.tolist() == [[False, False, False, True, True], [False, False, True, True, True]]
    assert b.logp_rollout[1, 2:].tolist() == [-1, -2, -3]
    sub = b.select(torch.tensor([0]))
    assert sub.tokens.shape == (1, 5) and float(sub.advantages[0]) == 1.0


def test_from_rows_matches_a_row_by_row_build():
    """from_rows fills its tensors in one pass; a row-by-row build of the same layout is its
    reference: random lengths (empty completions too), with and without environment-token masks."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        B = rng.randint(1, 12)
        P = [[rng.randrange(100) for _ in range(rng.randint(1, 9))] for _ in range(B)]
        C = [[rng.randrange(100) for _ in range(rng.randint(0, 5))] for _ in range(B)]
        L = [[-rng.random() for _ in c] for c in C]
        M = rng.choice([None, [[rng.randint(0, 1) for _ in c] if rng.random() < 0.5 else None for c in C]])
        b = Batch.from_rows(P, C, L, [1.0] * B, M)
        T = max(len(p) + len(c) for p, c in zip(P, C))
        tokens, mask, logp = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T)
        for r, (p, c, lp) in enumerate(zip(P, C, L)):
            tokens[r, : len(p) + len(c)] = torch.tensor(p + c)
            for j in range(len(c)):
                on = M is None or M[r] is None or bool(M[r][j])
                mask[r, len(p) + j], logp[r, len(p) + j] = on, lp[j] if on else 0.0
        assert torch.equal(b.tokens, tokens) and torch.equal(b.loss_mask, mask) and torch.equal(b.logp_rollout, logp)
        assert b.lengths.tolist() == [len(p) + len(c) for p, c in zip(P, C)] and b.lengths.dtype == torch.long


def test_micro_batches_respect_token_budget():
    lengths = torch.tensor([10, 3, 7, 7, 2, 9])
    groups = micro_batches(lengths, 20)
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    for g in groups:
        assert len(g) * int(lengths[g].max()) <= 20 or len(g) == 1
    assert micro_batches(torch.tensor([50]), 20)[0].tolist() == [0]  # oversize row alone


def test_sampler_is_seeded_and_covers_each_epoch():
    s1, s2 = prompts.Sampler(10, seed=3), prompts.Sampler(10, seed=3)
    first = s1.next(10)
    assert sorted(first) == list(range(10)) and first == s2.next(10)
    second = s1.next(10)
    assert sorted(second) == list(range(10)) and second != first  # each epoch: all items, new order
