"""Advantages and the clipped loss against small hand-derived numbers."""

import math

import pytest
import torch

from hybridrl.algorithms import advantages
from hybridrl.kernels.ppo_loss import ppo_loss


@pytest.mark.fast
def test_grpo_hand_derived():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    A = advantages.advantages("grpo", R)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(A[0], torch.tensor([a, -a, -a, a]), atol=1e-5, rtol=0)
    assert torch.equal(A[1], torch.zeros(4))  # no signal in a solved group


@pytest.mark.fast
def test_dr_grpo_and_rloo_hand_derived():
    R = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(advantages.advantages("dr_grpo", R), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # RLOO: 1 - mean(0, 0, 1) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(advantages.advantages("rloo", R), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))


def _loss(logp, old, adv, **kw):
    logp = torch.tensor(logp, requires_grad=True)
    loss, m = ppo_loss(
        logp,
        torch.tensor(old),
        torch.tensor(adv),
        torch.ones(len(adv)),
        seq_ids=torch.arange(len(adv)),
        eps_low=0.2,
        eps_high=0.28,
        **kw,
    )
    loss.backward()
    return float(loss), logp.grad, m


@pytest.mark.fast
def test_clipped_surrogate_hand_derived():
    # ratios 1.5 (A=+1) and 0.5 (A=-1): both clipped, to 1.28 and 0.8:
    # L = (max(-1.5, -1.28) + max(0.5, 0.8)) / 2 = (-1.28 + 0.8) / 2 = -0.24, gradient exactly 0
    loss, grad, m = _loss([math.log(1.5), math.log(0.5)], [0.0, 0.0], [1.0, -1.0])
    assert loss == pytest.approx(-0.24, abs=1e-6)
    assert torch.equal(grad, torch.zeros(2))
    assert float(m["clip_frac_high"]) == 0.5 and float(m["clip_frac_low"]) == 0.5
    # ratios 1.1 and 0.9 are inside the clip range: L = (-1.1 + 0.9) / 2 = -0.1,
    # dL/dlogp = -A * r / 2 = [-0.55, 0.45]
    loss, grad, _ = _loss([math.log(1.1), math.log(0.9)], [0.0, 0.0], [1.0, -1.0])
    assert loss == pytest.approx(-0.1, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([-0.55, 0.45]))


@pytest.mark.fast
def test_dual_clip_hand_derived():
    # A = -1, ratio 5: max(5, 0.8) = 5, then dual clip min(5, 3 * 1) = 3, gradient 0
    loss, grad, _ = _loss([math.log(5.0)], [0.0], [-1.0], dual_clip=3.0)
    assert loss == pytest.approx(3.0, abs=1e-6) and float(grad[0]) == 0.0


@pytest.mark.fast
def test_on_policy_ratio_is_one():
    # one update per rollout: old = logp.detach(), so ratio == 1 and L = -mean(A) = -(2 - 1) / 2
    loss, grad, m = _loss([-0.3, -2.0], [-0.3, -2.0], [2.0, -1.0])
    assert loss == pytest.approx(-0.5) and float(m["ratio_mean"]) == 1.0
    torch.testing.assert_close(grad, torch.tensor([-1.0, 0.5]))


# --- REINFORCE++ baseline, GAE, KL in the reward, the critic's loss ---------------------------------
from hybridrl.algorithms.advantages import ADVANTAGES, Experience  # noqa: E402


def _mask(prompt_len: int, completion_lens: list[int]) -> torch.Tensor:
    """[B, T] completion mask of rows with `prompt_len` prompt tokens, right-padded."""
    T = prompt_len + max(completion_lens)
    m = torch.zeros(len(completion_lens), T, dtype=torch.bool)
    for b, n in enumerate(completion_lens):
        m[b, prompt_len : prompt_len + n] = True
    return m


def _tokens(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m].tolist() for row, m in zip(x, mask)]


@pytest.mark.fast
def test_reinforce_pp_hand_derived():
    # groups [1, 0] and [1, 1]; completions of 2, 1, 1, 2 tokens; gamma 1, no KL.
    # baseline R - group mean: [0.5, -0.5], [0, 0]; the return of every token is its sample's:
    # tokens 0.5 0.5 | -0.5 | 0 | 0 0 -> n = 6, mean = 0.5 / 6 = 1/12;
    # deviations 5/12, 5/12, -7/12, -1/12 x 3 -> var = (25 + 25 + 49 + 3) / 144 / 6 = 17/144, std = sqrt(17)/12
    # whitened (x - 1/12) / (sqrt(17)/12) = (12 x - 1) / sqrt(17). The solved group [1, 1] moves off 0 (to
    # -1/sqrt(17)) because the token-weighted mean is not 0 when lengths differ (OpenRLHF's behaviour).
    R, mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), _mask(3, [2, 1, 1, 2])
    adv, returns = ADVANTAGES["reinforce_pp"](Experience(R, mask))
    s = math.sqrt(17)
    expected = [[5 / s, 5 / s], [-7 / s], [-1 / s], [-1 / s, -1 / s]]
    for got, want in zip(_tokens(adv, mask), expected):
        assert got == pytest.approx(want, abs=1e-5)  # std + eps (1e-6) moves the 6th digit
    assert returns is None and float(adv[~mask].abs().sum()) == 0.0


@pytest.mark.fast
def test_reinforce_pp_discounts_the_kl_penalty():
    # group [1, 0], completions of 3 and 1 tokens, beta * KL_t = 0.1 on every token, gamma 0.5.
    # token rewards: row 0 [-0.1, -0.1, 0.5 - 0.1 = 0.4], row 1 [-0.5 - 0.1 = -0.6]
    # returns: G2 = 0.4, G1 = -0.1 + 0.5 * 0.4 = 0.1, G0 = -0.1 + 0.5 * 0.1 = -0.05; row 1: -0.6
    R, mask = torch.tensor([[1.0, 0.0]]), _mask(2, [3, 1])
    base = (R - R.mean(1, keepdim=True)).flatten()
    G = advantages.discounted_returns(advantages.token_rewards(base, mask, 0.1 * mask.float()), mask, 0.5)
    assert _tokens(G, mask)[0] == pytest.approx([-0.05, 0.1, 0.4]) and _tokens(G, mask)[1] == pytest.approx([-0.6])
    adv, _ = ADVANTAGES["reinforce_pp"](Experience(R, mask, kl=0.1 * mask.float(), gamma=0.5))
    vals = [-0.05, 0.1, 0.4, -0.6]  # then whitened: mean -0.0375, population std
    mean = sum(vals) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4)
    assert sum(_tokens(adv, mask), []) == pytest.approx([(v - mean) / std for v in vals], abs=1e-5)


@pytest.mark.fast
def test_gae_hand_derived():
    # row 0: R = 1, values [0.5, 0.2, 0.4] on its 3 completion tokens, gamma 0.9, lambda 0.5 (gamma*lambda 0.45):
    #   delta_2 = 1 + 0.9 * 0 - 0.4 = 0.6           A_2 = 0.6
    #   delta_1 = 0 + 0.9 * 0.4 - 0.2 = 0.16        A_1 = 0.16 + 0.45 * 0.6 = 0.43
    #   delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32       A_0 = -0.32 + 0.45 * 0.43 = -0.1265
    #   returns A + V = [0.3735, 0.63, 1.0]
    # row 1: R = 0, value 0.1 on its 1 token, KL penalty 0.2 there: delta = -0.2 - 0.1 = -0.3 = A, return -0.2
    mask = _mask(1, [3, 1])
    values = torch.zeros(mask.shape)
    values[0, 1:4], values[1, 1] = torch.tensor([0.5, 0.2, 0.4]), 0.1
    values[1, 2:] = 7.0  # garbage off the mask is ignored
    kl = torch.zeros(mask.shape)
    kl[1, 1] = 0.2
    adv, returns = ADVANTAGES["gae"](Experience(torch.tensor([[1.0, 0.0]]), mask, kl, values, gamma=0.9, lam=0.5))
    assert _tokens(returns, mask) == [pytest.approx([0.3735, 0.63, 1.0]), pytest.approx([-0.2])]
    raw = [-0.1265, 0.43, 0.6, -0.3]  # whitened over the 4 tokens
    mean = sum(raw) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in raw) / 4)
    assert sum(_tokens(adv, mask), []) == pytest.approx([(v - mean) / std for v in raw], abs=1e-5)
    # gamma = lambda = 1: A_t = R - V_t (Monte-Carlo return minus the value), so the returns are R itself
    _, returns = ADVANTAGES["gae"](Experience(torch.tensor([[1.0, 0.0]]), mask, None, values, gamma=1.0, lam=1.0))
    assert _tokens(returns, mask) == [pytest.approx([1.0, 1.0, 1.0]), pytest.approx([0.0])]


@pytest.mark.fast
def test_kl_in_the_reward_of_a_group_estimator():
    # beta * sum_t KL_t comes off the sample's reward before the group baseline:
    # R = [1, 0], penalties [0.1 + 0.1, 0.3] -> R' = [0.8, -0.3]; dr_grpo: mean 0.25 -> [0.55, -0.55]
    mask = _mask(1, [2, 1])
    kl = torch.zeros(mask.shape)
    kl[0, 1:3], kl[1, 1] = 0.1, 0.3
    adv, returns = ADVANTAGES["dr_grpo"](Experience(torch.tensor([[1.0, 0.0]]), mask, kl))
    assert adv.tolist() == pytest.approx([0.55, -0.55]) and returns is None
    adv, _ = ADVANTAGES["grpo"](Experience(torch.tensor([[1.0, 0.0]]), mask))  # no KL: plain GRPO, one per sample
    torch.testing.assert_close(adv, advantages.advantages("grpo", torch.tensor([[1.0, 0.0]])).flatten())


@pytest.mark.fast
@pytest.mark.parametrize("kl_type,grad_at_0", [("k1", 1.0), ("k2", 0.0), ("k3", 0.0)])
def test_kl_is_zero_when_policy_equals_reference(kl_type, grad_at_0):
    # d = logp_ref - logp = 0: k1 = -0 = 0, k2 = 0, k3 = e^0 - 0 - 1 = 0; dk/dlogp = +1 (k1), -d = 0 (k2),
    # 1 - e^d = 0 (k3). The reward-side penalty gives the same numbers as the loss's estimator,
    # clamps included: logp = -30, 30, 15 against ref 0 (k3 capped at 10, see tests/kernels).
    logp = torch.tensor([-0.7, -2.0], requires_grad=True)
    loss, m = ppo_loss(
        logp, None, torch.zeros(2), torch.ones(2), logp_ref=logp.detach().clone(), kl_coef=1.0, kl_type=kl_type
    )
    loss.backward()
    assert float(loss) == 0.0 and float(m["kl_mean"]) == 0.0
    assert logp.grad.tolist() == pytest.approx([grad_at_0 / 2] * 2)
    lp = torch.tensor([[-30.0, 30.0, 15.0, 0.0]])
    pen = advantages.kl_penalty(lp, torch.zeros_like(lp), torch.ones_like(lp, dtype=torch.bool), kl_type, 0.5)
    _, m = ppo_loss(lp[0], None, torch.zeros(4), torch.ones(4), logp_ref=torch.zeros(4), kl_coef=0.5, kl_type=kl_type)
    assert float(pen[0, 3]) == 0.0 and float(pen.mean()) == pytest.approx(0.5 * float(m["kl_mean"]))


@pytest.mark.fast
def test_clipped_value_loss_hand_derived():
    # token 0: V 1.0, V_old 0.5, R 0: plain (1 - 0)^2 = 1; clipped 0.5 + 0.2 = 0.7 -> 0.49; max = 1 (plain),
    #          d/dV 0.5 * (V - R)^2 / 2 = (1 - 0) / 2 = 0.5
    # token 1: V 0.9, V_old 0.5, R 1: plain 0.01; clipped 0.7 -> (0.7 - 1)^2 = 0.09 wins: gradient exactly 0
    # loss = 0.5 * (1 + 0.09) / 2 = 0.2725; without clipping 0.5 * (1 + 0.01) / 2 = 0.2525
    V = torch.tensor([1.0, 0.9], requires_grad=True)
    old, R = torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])
    loss, m = advantages.value_loss(V, old, R, clip=0.2, normalizer=2.0)
    loss.backward()
    assert float(loss) == pytest.approx(0.2725) and float(m["value_clip_frac"]) == 0.5
    assert V.grad.tolist() == pytest.approx([0.5, 0.0])
    loss, _ = advantages.value_loss(V, old, R, clip=0.0, normalizer=2.0)
    assert float(loss) == pytest.approx(0.2525)


def _whiten_on_two_ranks(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from hybridrl.core.launch import all_sum

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    R, mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), _mask(3, [2, 1, 1, 2])
    mine = slice(2 * rank, 2 * rank + 2)  # rank 0 holds the group [1, 0], rank 1 the group [1, 1]
    adv, _ = ADVANTAGES["reinforce_pp"](Experience(R[rank : rank + 1], mask[mine], all_sum=all_sum))
    torch.save(adv, f"{out}.{rank}")
    dist.destroy_process_group()


def test_reinforce_pp_normalises_over_every_rank(tmp_path):
    """Two gloo ranks holding one group each give the numbers of one process holding both."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _whiten_on_two_ranks, args=(f"file://{tmp_path}/store", str(tmp_path / "adv")), nprocs=2, start_method="spawn"
    )
    R, mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), _mask(3, [2, 1, 1, 2])
    whole, _ = ADVANTAGES["reinforce_pp"](Experience(R, mask))
    parts = [torch.load(tmp_path / f"adv.{r}") for r in (0, 1)]
    torch.testing.assert_close(parts[0], whole[:2, : parts[0].shape[1]])
    torch.testing.assert_close(parts[1], whole[2:, : parts[1].shape[1]])


@pytest.mark.fast
def test_estimator_names_match_the_config():
    from hybridrl.core import config

    assert tuple(ADVANTAGES) == config.ADVANTAGES
    with pytest.raises(config.ConfigError, match="must be one of grpo, dr_grpo, rloo, reinforce_pp, gae"):
        config.load(overrides={"algo.advantage": "ppo"})
    with pytest.raises(config.ConfigError, match="train.kernels=liger"):
        config.load(overrides={"algo.advantage": "gae", "train.kernels": "liger"})


@pytest.mark.fast
def test_estimate_reduces_with_the_reduction_it_is_given():
    """estimate imports nothing distributed: the caller's all_sum (launch.all_sum in a run) is what
    whitening and the metrics sum over ranks with. Here it stands in for a second rank holding the
    same rows: sums double, so the means, the whitened advantages and the metrics are one rank's."""
    from types import SimpleNamespace

    from hybridrl.core.schema import AlgoConfig

    calls = []

    def twice(values):
        calls.append(list(values))
        return [2 * v for v in values]

    R, mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), _mask(3, [2, 1, 1, 2])
    batch = SimpleNamespace(loss_mask=mask, logp_old=None, logp_ref=None, logp_teacher=None, values=None)
    algo = AlgoConfig(advantage="reinforce_pp", kl_coef=0.0)
    adv, _, metrics = advantages.estimate(algo, R, batch, all_sum=twice)
    alone, _, alone_metrics = advantages.estimate(algo, R, batch, all_sum=lambda v: v)
    assert len(calls) == 3  # whiten's mean and variance, then the metrics
    torch.testing.assert_close(adv, alone)
    assert metrics == pytest.approx(alone_metrics)
    with pytest.raises(TypeError, match="all_sum"):
        advantages.estimate(algo, R, batch)  # no default: a multi-rank caller must not whiten its share alone
