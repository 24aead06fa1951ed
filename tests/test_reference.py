"""The reference policy of the KL penalty: nothing is loaded at beta = 0; with the KL in the reward
(the real engines, through the CLI) the penalty is exactly 0 while policy == reference, then grows.
The KL in the loss is checked with the critic's resume run in test_critic.py."""
import pytest
import torch

from test_train_e2e import train_cli


def test_no_reference_model_is_loaded_when_beta_is_zero():
    from hybridrl import config
    from hybridrl.reference import Reference
    cfg = config.load(overrides={"algo.kl_coef": 0.0})
    kw = dict(device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    assert Reference.load(cfg, "/no/such/model", **kw) is None  # would raise if it tried to load anything
    with pytest.raises(OSError):
        Reference.load(config.load(overrides={"algo.kl_coef": 0.1}), "/no/such/model", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp"])
def test_kl_in_the_reward_is_zero_at_step_one_then_grows(tmp_path, advantage):
    _, steps, _ = train_cli(tmp_path / "run", "--steps", "4", "--algo.kl_coef", "0.1", "--algo.kl_in", "reward",
                            "--algo.kl_type", "k1", "--algo.advantage", advantage)
    # the trainer's log-probs of the sampling policy (old_logprob) against the reference's: the same
    # weights and kernels at step 1, so every KL_t is exactly 0
    assert steps[0]["kl_reward"] == 0.0 and steps[0]["kl_mean"] == 0.0
    assert all(s["time/old_logprob"] > 0 and s["time/ref_logprob"] > 0 for s in steps)
    assert all(s["kl_mean"] > 1e-6 for s in steps[1:])
    # k1 can be negative per token; its batch mean is positive once the policy moved
    assert any(s["kl_reward"] != 0.0 for s in steps[1:])
