import math
import re
import subprocess
import sys
import time

import pytest

from hybridrl.core import config as C
from hybridrl.run.cli import _strip_launch_flags


@pytest.mark.fast
def test_defaults_validate():
    cfg = C.Config()
    C.validate(cfg)
    assert cfg.model.path == "demo" and cfg.train.zero_stage in (2, 3)


@pytest.mark.fast
def test_every_field_has_help():
    for key, f in C.leaves().items():
        assert f.metadata.get("help"), key


@pytest.mark.fast
def test_overrides_are_typed():
    cfg = C.load(
        None,
        {
            "algo.clip_high": "0.28",
            "train.steps": "7",
            "rollout.enable_prefix_caching": "false",
            "train.betas": "0.9, 0.95",
            "train.lr": "1e-5",
        },
    )
    assert cfg.algo.clip_high == 0.28 and cfg.train.steps == 7 and cfg.rollout.enable_prefix_caching is False
    assert cfg.train.betas == [0.9, 0.95] and cfg.train.lr == 1e-5


@pytest.mark.fast
def test_unknown_key_names_closest():
    with pytest.raises(C.ConfigError, match="did you mean 'algo.clip_high'"):
        C.load(None, {"algo.clip_hihg": 0.3})
    with pytest.raises(C.ConfigError, match="did you mean 'train.lr'"):
        C.load(None, {"trian.lr": 0.3})


@pytest.mark.fast
def test_bad_values_say_what_to_change():
    with pytest.raises(C.ConfigError, match="must be one of"):
        C.load(None, {"algo.loss_agg": "mean"})
    with pytest.raises(C.ConfigError, match="train.zero_stage=1: must be 2 or 3"):
        C.load(None, {"train.zero_stage": 1})
    with pytest.raises(C.ConfigError, match="raise rollout.max_model_len"):
        C.load(None, {"rollout.max_model_len": 16, "data.max_prompt_len": 15})


@pytest.mark.fast
def test_settings_not_built_are_refused_with_the_fix():
    # tensor parallelism: in process only (the external launcher), 1..8
    assert C.load(None, {"rollout.tensor_parallel_size": 2}).rollout.tensor_parallel_size == 2
    for over, fix in [
        ({"rollout.mode": "outofprocess"}, "use rollout.mode=inprocess"),
        ({"rollout.tensor_parallel_size": 16}, r"in \[1, 8\]"),
    ]:
        with pytest.raises(C.ConfigError, match=fix) as e:
            C.load(None, {"rollout.tensor_parallel_size": 2, **over})
        assert "\n" not in str(e.value)
    # fp16 without loss scaling: refused; bf16 and fp32 are fine
    with pytest.raises(C.ConfigError, match="model.dtype=float16 is not supported: .* use model.dtype=bfloat16"):
        C.load(None, {"model.dtype": "float16"})
    for dtype in ("auto", "bfloat16", "float32"):
        assert C.load(None, {"model.dtype": dtype}).model.dtype == dtype


@pytest.mark.fast
def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: 3.0e-5\n  steps: 9\nalgo:\n  clip_high: 0.3\n")
    cfg = C.load(f, {"train.steps": 11})
    assert cfg.train.lr == 3e-5 and cfg.train.steps == 11 and cfg.algo.clip_high == 0.3
    f.write_text("train:\n  lr: 1\n  stpes: 9\n")
    with pytest.raises(C.ConfigError, match="train.steps"):
        C.load(f)


@pytest.mark.fast
def test_launch_flags_are_not_passed_to_workers():
    argv = ["train", "--nproc", "2", "--steps", "3", "--nnodes=1", "--train.zero_stage", "3"]
    assert _strip_launch_flags(argv) == ["train", "--steps", "3", "--train.zero_stage", "3"]


def test_cli_help_shows_groups_and_rejects_typos():
    def run(*a):
        return subprocess.run([sys.executable, "-m", "hybridrl", "train", *a], capture_output=True, text=True)

    out = run("--help")
    assert out.returncode == 0
    for group in C.GROUPS:
        assert f"\n{group}:\n" in out.stdout, group
    bad = run("--algo.clip_hgh", "0.3")
    assert bad.returncode == 2 and "--algo.clip_high" in bad.stderr
    bad = run("--set", "algo.clip_hgh=0.3")
    assert bad.returncode == 2 and "did you mean 'algo.clip_high'" in bad.stderr


NUMERIC = [k for k, f in C.leaves().items() if C._field_type(*k.split(".")) in (int, float)]


def _outside(spec: str) -> list:
    """Values a range spec excludes: just past each bound, and NaN / inf."""
    cands = [math.nan, math.inf]
    for alt in spec.split(" or "):
        nums = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", alt)]
        for x in nums:
            cands += [x - 1, x - 0.5, x + 0.5, x + 1, x]
    return [v for v in cands if not C.in_range(v, spec)]


@pytest.mark.fast
@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_knob_refuses_values_out_of_its_range(key):
    """Each int/float knob declares its range (schema.knob's `valid`); its default is in it, and every
    value outside it (past each bound, NaN, inf) is refused by the config, in one line naming the knob
    and the range. Before: --train.lr -1, --train.max_minutes -1, --log.eval_size -5 were accepted."""
    spec = C.leaves()[key].metadata.get("valid")
    assert spec, f"{key} declares no range: add valid=... to its knob in schema.py"
    group, name = key.split(".")
    assert C.in_range(getattr(getattr(C.Config(), group), name), spec), key
    is_int = C._field_type(group, name) is int
    bad = [v for v in _outside(spec) if not is_int or (math.isfinite(v) and float(v).is_integer())]
    assert bad, key
    for v in bad:
        with pytest.raises(C.ConfigError) as e:
            C.load(None, {key: int(v) if is_int else v})
        msg = str(e.value)
        assert "\n" not in msg and key in msg, (key, v, msg)


@pytest.mark.fast
@pytest.mark.parametrize(
    "over,words",
    [
        ({"train.lr": -1}, "train.lr=-1.0: must be a finite number in (0, 1]"),
        ({"train.max_minutes": -1}, "train.max_minutes=-1.0: must be a finite number >= 0"),
        ({"log.eval_size": -5}, "log.eval_size=-5: must be a finite number >= 0"),
        (
            {"rollout.temperature": 0},
            "rollout.temperature=0.0: must be a finite number > 0; at 0 vLLM samples greedily",
        ),
        ({"train.lr": "nan"}, "train.lr=nan: must be a finite number"),
    ],
)
def test_the_issues_knobs_are_refused_by_name(over, words):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, over)
    assert words in str(e.value)


def test_an_out_of_range_flag_fails_before_the_engines():
    """The CLI refuses --train.lr -1 in one line, in about the time Python takes to start: before torch,
    vLLM or DeepSpeed are imported (before: one step ran, then a StaleWeightsError blamed the hand-off)."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl", "train", "--train.lr", "-1"], capture_output=True, text=True, timeout=120
    )
    took = time.perf_counter() - t0
    assert out.returncode != 0
    err = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert err == ["error: train.lr=-1.0: must be a finite number in (0, 1]"], err
    assert took < 15, took  # ~1-2 s idle; a loaded 2-core machine is slower, an engine start is 20 s+


def test_specs_saved_before_the_role_folders_still_resolve():
    """A run directory written before the package was grouped into folders names the old flat
    modules in its config (env.cls, reward.fn): resuming or evaluating it still imports them."""
    from hybridrl.data.envs import ToolEnv
    from hybridrl.data.tasks.arithmetic import DEMO_MODEL_DIR

    assert C.import_spec("env.cls", "hybridrl.envs:ToolEnv", "hybridrl.envs:ToolEnv") is ToolEnv
    assert C.import_spec("k", "s", "hybridrl.tasks.arithmetic:DEMO_MODEL_DIR") == DEMO_MODEL_DIR
    assert C.import_spec("k", "s", "hybridrl.data.envs:ToolEnv") is ToolEnv  # today's name
    assert DEMO_MODEL_DIR.is_dir() and sorted(C.MOVED) == sorted(set(C.MOVED))


def test_every_module_moved_still_imports_under_its_new_name():
    import importlib

    for new in C.MOVED.values():
        importlib.import_module(f"hybridrl.{new}")


def test_built_in_tasks_bring_their_lengths_and_reward_on_the_demo_model():
    """data.path=code on the demo model: its programs' length and the code_tests reward, unless set;
    back to the demo's task (or another model), what the code task's recipe put goes back."""
    cfg = C.load(None, {"data.path": "code"})
    assert (cfg.reward.fn, cfg.rollout.max_new_tokens, cfg.data.max_prompt_len) == ("code_tests", 28, 20)
    assert not C.explicit(cfg, "reward.fn")
    cfg = C.apply(cfg, {"data.path": "longtail"})
    assert (cfg.reward.fn, cfg.rollout.max_new_tokens) == ("arithmetic", 48)
    cfg = C.apply(cfg, {"data.path": "demo"})
    assert (cfg.reward.fn, cfg.rollout.max_new_tokens) == ("arithmetic", C.DEMO["rollout.max_new_tokens"])
    mine = C.load(None, {"data.path": "code", "reward.fn": "code_tests:2", "rollout.max_new_tokens": "40"})
    assert (mine.reward.fn, mine.rollout.max_new_tokens) == ("code_tests:2", 40)
