"""The loss knobs (algo.policy_loss, is_correction, cispo/is_mask bounds) validate with one-line
errors that name the fix."""

import pytest

from hybridrl.core import config as C

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

BAD = [
    ({"algo.policy_loss": "grpo"}, "algo.policy_loss='grpo': must be one of ppo, cispo, gmpo, gspo, gspo_token"),
    ({"algo.policy_loss": "cispo", "algo.dual_clip": 3}, "cispo has not: set algo.dual_clip 0"),
    ({"algo.cispo_clip_high": -1}, "algo.cispo_clip_high=-1.0: must be a finite number >= 0"),
    (
        {"algo.is_correction": "mask", "algo.is_mask_low": 1.5},
        "algo.is_mask_low=1.5: must be a finite number in [0, 1]",
    ),
    ({"algo.is_correction": "mask", "algo.is_mask_high": 0.9}, "algo.is_mask_high=0.9: must be a finite number >= 1"),
    ({"algo.is_correction": "mask", "algo.tis_cap": 2}, "set algo.tis_cap 0 with mask"),
    ({"algo.tis_level": "seq"}, "must be one of token, sequence, geometric"),
    (
        {"train.kernels": "liger", "algo.policy_loss": "gspo_token"},
        "use algo.policy_loss ppo/cispo/gspo or train.kernels=auto",
    ),
    (
        {"train.kernels": "liger", "algo.policy_loss": "cispo", "algo.loss_agg": "seq_mean_token_mean"},
        "use algo.loss_agg token_mean and algo.cispo_clip_low 1, or train.kernels=auto",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_loss_settings_fail_in_one_line(overrides, message):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        {"algo.policy_loss": "gspo", "algo.clip_low": 3e-4, "algo.clip_high": 4e-4},
        {"algo.policy_loss": "gspo_token", "algo.advantage": "reinforce_pp"},
        {"algo.policy_loss": "cispo", "algo.cispo_clip_low": 0.2, "algo.cispo_clip_high": 0.28},
        {
            "algo.is_correction": "mask",
            "algo.tis_level": "geometric",
            "algo.is_mask_low": 0.8,
            "algo.is_mask_high": 1.25,
        },
        {"train.kernels": "liger", "algo.policy_loss": "cispo"},
        {"train.kernels": "liger", "algo.policy_loss": "gspo"},
        {"train.kernels": "liger", "algo.tis_cap": 2},
    ],
)
def test_good_loss_settings_load(overrides):
    cfg = C.load(None, overrides)
    for key, value in overrides.items():
        group, name = key.split(".")
        assert getattr(getattr(cfg, group), name) == value
