"""DAPO's batch shaping as pure functions, against hand-made reward matrices and hand-derived numbers."""

import pytest
import torch

from hybridrl.algorithms import dapo

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def test_mixed_groups():
    R = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.2]])
    assert dapo.mixed_groups(R).tolist() == [True, False, False, True]


def test_fill_drops_flat_groups_and_refills():
    # target 4 groups. Round 1: groups 0 and 2 have signal (2 kept); round 2: groups 1, 2, 3 (3 more,
    # 5 in all) -> stop after 2 rounds, train on the first 4: (0,0), (0,2), (1,1), (1,2)
    r1 = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    r2 = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    never = torch.full((4, 2), float("nan"))  # a third round must not be generated
    pulled = []

    def rounds():
        for R in (r1, r2, never):
            pulled.append(R)
            yield R

    plan = dapo.fill(rounds(), target=4, max_rounds=5)
    assert plan.kept == [(0, 0), (0, 2), (1, 1), (1, 2)]
    assert plan.rounds == 2 and len(pulled) == 2 and not plan.cap_hit and plan.kept_per_rank == [5]


def test_fill_cap_trains_on_what_there_is():
    flat = torch.ones(3, 2)
    one = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    plan = dapo.fill(iter([flat, one, flat, one]), target=3, max_rounds=3)
    assert plan.kept == [(1, 0)] and plan.rounds == 3 and plan.cap_hit


def test_fill_off_keeps_everything_in_one_round():
    R = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    plan = dapo.fill(iter([R, R]), target=2, max_rounds=4, dynamic=False)
    assert plan.kept == [(0, 0), (0, 1)] and plan.rounds == 1 and not plan.cap_hit


def test_fill_takes_the_same_decisions_on_every_rank():
    # two ranks; all_sum is what launch.all_sum returns: rank 0 holds 1 group with signal, rank 1 holds 4
    counts = [1.0, 4.0]
    plans = [
        dapo.fill(
            iter([torch.tensor([[1.0, 0.0]] * int(counts[r]))]),
            target=4,
            max_rounds=2,
            rank=r,
            world_size=2,
            all_sum=lambda v: counts,
        )
        for r in range(2)
    ]
    assert [p.rounds for p in plans] == [1, 1]
    assert [len(p.kept) for p in plans] == [1, 3]  # = shares([1, 4], 4)


def test_shares_spread_the_surplus_trim():
    assert dapo.shares([5, 5], 8) == [4, 4]
    assert dapo.shares([1, 9], 8) == [1, 7]  # a rank cannot give more than it has
    assert dapo.shares([3, 2, 6, 0], 8) == [3, 2, 3, 0]
    assert dapo.shares([1, 1], 8) == [1, 1]  # cap hit: all there is
    assert dapo.shares([0, 0], 8) == [0, 0]


def test_overlong_penalty_hand_derived():
    # L_max = 20, buffer 4: no penalty up to 16 tokens, then -(L - 16) / 4 * factor:
    # 17 -> -0.25, 18 -> -0.5, 20 -> -1.0; factor 0.5 halves them; beyond L_max stays at -factor
    L = torch.tensor([3, 16, 17, 18, 20, 25])
    torch.testing.assert_close(dapo.overlong_penalty(L, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        dapo.overlong_penalty(L, 20, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )
    assert torch.equal(dapo.overlong_penalty(L, 20, 0), torch.zeros(6))  # off
