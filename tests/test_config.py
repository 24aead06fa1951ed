import subprocess
import sys

import pytest

from hybridrl import config as C
from hybridrl.cli import _strip_launch_flags


def test_defaults_validate():
    cfg = C.Config()
    C.validate(cfg)
    assert cfg.model.path == "demo" and cfg.train.zero_stage in (2, 3)


def test_every_field_has_help():
    for key, f in C.leaves().items():
        assert f.metadata.get("help"), key


def test_overrides_are_typed():
    cfg = C.load(None, {"algo.clip_high": "0.28", "train.steps": "7", "rollout.enable_prefix_caching": "false",
                        "train.betas": "0.9, 0.95", "train.lr": "1e-5"})
    assert cfg.algo.clip_high == 0.28 and cfg.train.steps == 7 and cfg.rollout.enable_prefix_caching is False
    assert cfg.train.betas == [0.9, 0.95] and cfg.train.lr == 1e-5


def test_unknown_key_names_closest():
    with pytest.raises(C.ConfigError, match="did you mean 'algo.clip_high'"):
        C.load(None, {"algo.clip_hihg": 0.3})
    with pytest.raises(C.ConfigError, match="did you mean 'train.lr'"):
        C.load(None, {"trian.lr": 0.3})


def test_bad_values_say_what_to_change():
    with pytest.raises(C.ConfigError, match="must be one of"):
        C.load(None, {"algo.loss_agg": "mean"})
    with pytest.raises(C.ConfigError, match="zero_stage must be 2 or 3"):
        C.load(None, {"train.zero_stage": 1})
    with pytest.raises(C.ConfigError, match="raise rollout.max_model_len"):
        C.load(None, {"rollout.max_model_len": 16, "data.max_prompt_len": 15})


def test_settings_not_built_are_refused_with_the_fix():
    # tensor parallelism: in process only (the external launcher), 1..8
    assert C.load(None, {"rollout.tensor_parallel_size": 2}).rollout.tensor_parallel_size == 2
    for over, fix in [({"rollout.mode": "outofprocess"}, "use rollout.mode=inprocess"),
                      ({"rollout.tensor_parallel_size": 16}, "use 1 to 8")]:
        with pytest.raises(C.ConfigError, match=fix) as e:
            C.load(None, {"rollout.tensor_parallel_size": 2, **over})
        assert "\n" not in str(e.value)
    # fp16 without loss scaling: refused; bf16 and fp32 are fine
    with pytest.raises(C.ConfigError, match="model.dtype=float16 is not supported: .* use model.dtype=bfloat16"):
        C.load(None, {"model.dtype": "float16"})
    for dtype in ("auto", "bfloat16", "float32"):
        assert C.load(None, {"model.dtype": dtype}).model.dtype == dtype


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: 3.0e-5\n  steps: 9\nalgo:\n  clip_high: 0.3\n")
    cfg = C.load(f, {"train.steps": 11})
    assert cfg.train.lr == 3e-5 and cfg.train.steps == 11 and cfg.algo.clip_high == 0.3
    f.write_text("train:\n  lr: 1\n  stpes: 9\n")
    with pytest.raises(C.ConfigError, match="train.steps"):
        C.load(f)


def test_launch_flags_are_not_passed_to_workers():
    argv = ["train", "--nproc", "2", "--steps", "3", "--nnodes=1", "--train.zero_stage", "3"]
    assert _strip_launch_flags(argv) == ["train", "--steps", "3", "--train.zero_stage", "3"]


def test_cli_help_shows_groups_and_rejects_typos():
    run = lambda *a: subprocess.run([sys.executable, "-m", "hybridrl", "train", *a], capture_output=True, text=True)
    out = run("--help")
    assert out.returncode == 0
    for group in C.GROUPS:
        assert f"\n{group}:\n" in out.stdout, group
    bad = run("--algo.clip_hgh", "0.3")
    assert bad.returncode == 2 and "--algo.clip_high" in bad.stderr
    bad = run("--set", "algo.clip_hgh=0.3")
    assert bad.returncode == 2 and "did you mean 'algo.clip_high'" in bad.stderr
