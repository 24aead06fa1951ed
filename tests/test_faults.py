"""The fault-injection suite of issue 7: each fault, what must be kept, and what the user is told.

Real engines through the CLI. Faults land at a chosen phase of a chosen step through the
test-only variable HYBRIDRL_TEST_FAULT="<action>@<step>:<phase>[:rank<R>]" (hybridrl/core/faults.py:
kill, term, hang, fill, enospc); a NaN loss through HYBRIDRL_TEST_NAN_AT_STEP (trainer.py).

Where each fault of the issue's list is tested (the ones that already worked stay where they were):

  kill -9 mid-step, then --resume auto       here: test_kill_9_mid_step_then_resume_repeats_the_run
  SIGTERM mid-step (checkpoint, exit 0)      test_checkpoint.py::test_signal_stops_after_a_checkpoint_
                                             and_resume_auto_continues (SIGINT -> 130: same test, slow)
  one rank killed at 2 ranks                 test_train_e2e.py::test_a_dead_rank_stops_the_others_with_its_name
  one rank hanging at 2 ranks (watchdog)     here: test_a_stalled_rank_is_named_and_the_run_stops
  a crashing reward function                 test_train_e2e.py::test_user_data_reward_module_and_bad_rows
                                             (scored 0 and counted); a hanging one: NOT here (the reward
                                             pipeline is being rebuilt with a timeout, see README status)
  NaN injected into the loss                 test_checkpoint.py::test_nonfinite_loss_skips_the_update_and_is_counted
  truncated / corrupt checkpoint             here: test_corrupt_checkpoint_is_skipped_and_named (the user's
                                             message); the rules: test_checkpoint.py::test_incomplete_or_
                                             truncated_checkpoint_is_never_loaded
  no space left while checkpointing          here: test_no_space_left_while_checkpointing
  a CUDA/NCCL error while checkpointing      here: test_only_io_errors_while_saving_are_survived (it stops
                                             the run; only I/O errors are survived)
  malformed data                             here: test_malformed_rows_name_the_row; test_train_e2e.py::
                                             test_bad_input_fails_fast_with_the_fix (CLI, exit 2);
                                             test_batch_data.py (bad JSON line, missing key, overlong prompts)
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.core import config
from hybridrl.data import prompts
from hybridrl.run import checkpoint

from helpers.checkpoints import FAST, _steps
from helpers.cli import SMALL, train_cli

STEPS = 4  # each run's length; the kill lands in step 3


def _popen(run_dir, *args, fault="", prefix=()):
    cmd = [*prefix, sys.executable, "-m", "hybridrl", "train", *SMALL, *FAST, "--log.run_dir", str(run_dir), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYBRIDRL_TEST_FAULT": fault}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _logged_steps(metrics) -> set[int]:
    """Steps with a metrics line so far (the file is being written: a last line may be partial)."""
    out = set()
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "reward" in r:
            out.add(r["step"])
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """An uninterrupted run, and one SIGKILLed on entering the train phase of step 3 (a checkpoint
    every step) and then resumed with --resume auto."""
    root = tmp_path_factory.mktemp("kill")
    _, full, _ = train_cli(root / "full", *FAST, "--steps", str(STEPS))
    run = root / "part"
    dead = _popen(run, "--steps", str(STEPS), "--ckpt.every", "1", fault="kill@3:train")
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    before = _steps(_records(run))
    out, after, summary = train_cli(run, *FAST, "--steps", str(STEPS), "--resume", "auto")
    return dict(
        full=_steps(full), dead=dead, ckpts=ckpts, before=before, out=out, after=_steps(after), summary=summary, run=run
    )


@pytest.mark.cpu_only("bit-identical resumes rest on deterministic CPU kernels")
def test_kill_9_mid_step_then_resume_repeats_the_run(killed):
    """kill -9 mid-step loses that step only: the run had finished and saved steps 1-2, the
    resume continues from step-2 and its steps 3-4 equal the uninterrupted run's."""
    assert killed["dead"].returncode == -9  # SIGKILL: no handler ran, nothing more was written
    assert killed["ckpts"] == ["latest", "step-1", "step-2"]  # keep 2; step 3 never reached its save
    assert sorted(killed["before"]) == [1, 2]  # the metrics of the finished steps survived the crash
    assert f"resuming from {killed['run'] / 'checkpoints' / 'step-2'} (step 2)" in killed["out"].stdout
    a, b = killed["full"], killed["after"]
    assert sorted(b) == list(range(1, STEPS + 1))  # steps 1-2 kept from before the crash, 3-4 redone/new
    for s in range(1, STEPS + 1):
        for key in ("loss", "reward", "grad_norm", "entropy_mean", "rollout_tokens"):
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])  # bit-identical
    assert killed["summary"]["steps"] == STEPS


def test_corrupt_checkpoint_is_skipped_and_named(killed, tmp_path, caplog):
    """A truncated shard in the newest checkpoint: resume takes the one before and says why."""
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(killed["run"] / "checkpoints", root)
    shard = sorted((root / f"step-{STEPS}" / "ds").iterdir())[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # half of it, as a full disk or crash leaves
    cfg = config.load(overrides={"log.run_dir": str(tmp_path / "run"), "ckpt.resume": "auto"})
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        assert checkpoint.locate(cfg)[0] == root / f"step-{STEPS - 1}"
    assert (
        f"checkpoint {root / f'step-{STEPS}'} is incomplete or corrupt (files missing or truncated): skipped"
        in caplog.text
    )


def _can_mount_tmpfs(where) -> bool:
    """A private tmpfs needs no root: `unshare -rm` maps us to root in a new user+mount namespace."""
    try:
        return (
            subprocess.run(
                ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def test_no_space_left_while_checkpointing(tmp_path):
    """The checkpoint directory is a real 40 MiB tmpfs (one checkpoint is 13-14 MiB), mounted in a
    private mount namespace. At step 2's save a test hook fills that disk (as another job's data
    would) before DeepSpeed writes, so DeepSpeed's torch.save fails with a real ENOSPC. Expected:
    the partial step-2 is removed, step-1 survives intact, the user is told (path, the size a
    checkpoint needs, what is free, what to do), training goes on; step 3's save (the last) finds
    too little space before writing, so the run exits 1 with that message.
    Where no tmpfs can be mounted, OSError(ENOSPC) is raised at the same point instead (the fill
    hook would fill a real disk); the final save then succeeds."""
    disk, run, keep = tmp_path / "disk", tmp_path / "run", tmp_path / "kept"
    disk.mkdir()
    real = _can_mount_tmpfs(disk)
    args = ["--steps", "3", "--ckpt.every", "1", "--ckpt.keep", "2", "--ckpt.dir", str(disk / "ck")]
    if real:
        # the tmpfs lives as long as the namespace: list and copy what the run kept before leaving it
        script = (
            f'mount -t tmpfs -o size=40m tmpfs {disk} && "$@"; rc=$?; ls {disk}/ck > {tmp_path}/listing; '
            f"cp -a {disk}/ck/step-1 {keep}; exit $rc"
        )
        res = _popen(run, *args, fault="fill@2:save", prefix=("unshare", "-rm", "sh", "-c", script, "sh"))
        kept = (tmp_path / "listing").read_text().split()
    else:
        res = _popen(run, *args, fault="enospc@2:save")
        kept = sorted(p.name for p in (disk / "ck").iterdir())
        shutil.copytree(disk / "ck" / "step-1", keep)
    records = _records(run)
    summary = records[-1]["summary"]
    assert sorted(_steps(records)) == [1, 2, 3]  # the failed save did not stop training
    assert checkpoint.is_complete(keep) and json.loads((keep / "state.json").read_text())["step"] == 1
    assert not [k for k in kept if k.startswith("tmp-")]  # the partial checkpoint was removed
    told = (
        f"checkpoint of step 2 NOT saved under {disk / 'ck'}: no space left on device",
        "A checkpoint needs ~1",
        f"Kept: {disk / 'ck' / 'step-1'} (the partial one was removed)",
        "point --ckpt.dir at a bigger disk",
        "training goes on; the next save is at step 3",
    )
    for text in told:
        assert text in res.stderr, (text, res.stderr[-3000:])
    if real:
        assert res.returncode == 1 and summary["exit_code"] == 1 and summary["checkpoint_failures"] == 2
        assert kept == ["latest", "step-1", "test-disk-filler"]
        assert (
            "checkpoint of step 3 NOT saved" in res.stderr
            and "not enough free space (checked before writing)" in res.stderr
            and "the run ends without a checkpoint of its last steps" in res.stderr
        )
    else:
        assert res.returncode == 0 and summary["checkpoint_failures"] == 1 and kept == ["latest", "step-1", "step-3"]


def _torch_write_error() -> RuntimeError:
    """What torch.save raises when the disk fills under it (DeepSpeed's shards are torch.saved)."""
    import torch

    try:
        torch.save({"w": torch.zeros(1 << 16)}, "/dev/full")  # every write: ENOSPC
    except RuntimeError as e:
        return e
    raise AssertionError("torch.save to /dev/full succeeded")


@pytest.mark.fast
@pytest.mark.parametrize(
    "error,handled",
    [
        (_torch_write_error(), True),  # "[enforce fail at inline_container.cc:...] . unexpected pos ..."
        (OSError(5, "Input/output error"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (__import__("torch").distributed.DistBackendError("NCCL communicator was aborted on rank 1"), False),
        (ValueError("a bug"), False),
    ],
    ids=["torch-enospc", "eio", "cuda", "nccl", "bug"],
)
def test_only_io_errors_while_saving_are_survived(tmp_path, capsys, error, handled):
    """Saver.save on one rank, DeepSpeed's save replaced by one that raises `error` (a state-machine
    test of the error policy; the real full disk is test_no_space_left_while_checkpointing): an I/O
    error is reported, its partial directory removed and training may go on; a CUDA or NCCL failure
    or a bug propagates instead of reading as a full disk."""
    from types import SimpleNamespace

    import torch

    from hybridrl.core.launch import World
    from hybridrl.engines.seams import Engines

    def save_checkpoint(path, **kw):
        (Path(path) / "ds").mkdir(parents=True)  # a partial shard directory
        raise error

    trainer = SimpleNamespace(save_checkpoint=save_checkpoint, hf=torch.nn.Linear(4, 4), peft=None)
    cfg = config.load(None, {"ckpt.dir": str(tmp_path / "ck")})
    saver = checkpoint.Saver(cfg, tmp_path, World(0, 1, 0, torch.device("cpu")), tokenizer=None)
    args = (1, Engines(trainer), SimpleNamespace(cursor=0), SimpleNamespace(last=None, tol=2e-2), {})
    if handled:
        assert saver.save(*args) is None and saver.failures == 1
        assert "checkpoint of step 1 NOT saved" in capsys.readouterr().err
        assert list((tmp_path / "ck").iterdir()) == []  # the partial tmp-step-1 was removed
    else:
        with pytest.raises(type(error)):
            saver.save(*args)
    assert checkpoint.is_io_error(error) is handled


@pytest.mark.devices(2)
def test_a_stalled_rank_is_named_and_the_run_stops(tmp_path):
    """Rank 1 of 2 sleeps forever on entering step 3 (a stuck verifier, a deadlocked thread): rank 0
    blocks in its next collective. Both watchdogs (train.watchdog_s=20: twice the longest phase seen on
    a 2-core machine shared by five runs, so only the stall trips it) fire; the run ends within
    60 s of the stall with exit 1, a message naming rank 1 and where it stalled, each rank's
    stacks on disk, and the step-2 checkpoint intact."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        *SMALL,
        *FAST,
        "--steps",
        "50",
        "--nproc",
        "2",
        "--ckpt.every",
        "2",
        "--train.watchdog_s",
        "20",
        "--log.run_dir",
        str(run),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HYBRIDRL_TEST_FAULT": "hang@3:generate:rank1"},
    )
    metrics, deadline = run / "metrics.jsonl", time.time() + 600
    while time.time() < deadline and proc.poll() is None:  # step 2's line: step 3 (and the stall) is next
        if metrics.exists() and 2 in _logged_steps(metrics):
            break
        time.sleep(0.2)
    t0 = time.time()
    out, err = proc.communicate(timeout=300)
    assert time.time() - t0 < 60, err[-3000:]
    assert proc.returncode == 1, err[-3000:]
    # whichever watchdog fires first (rank 1's own, or rank 0's while it waits) names rank 1; the
    # launcher then stops the other rank, which may not get to print
    assert "hybridrl watchdog: rank " in err and "Cause: rank 1 stalled in phase 'generate' of step 3 (" in err, err[
        -3000:
    ]
    assert "was stopped by its watchdog" in err  # the launcher's summary line
    assert "_inject" in (run / "watchdog-rank1.txt").read_text()  # the stalled rank's stack: where it hangs
    ck = run / "checkpoints" / "step-2"
    assert checkpoint.is_complete(ck) and json.loads((ck / "state.json").read_text())["step"] == 2
    assert sorted(_steps(_records(run))) == [1, 2]


@pytest.mark.fast
def test_malformed_rows_name_the_row(tmp_path):
    """Rows that are not objects, or whose prompt is not text, stop the run at load with file:line
    (every format's locations: tests/test_data.py)."""
    cfg = config.DataConfig()
    for lines, msg in [
        (
            ['{"prompt": "1+1=", "answer": "2"}', '["1+1="]'],
            "x.jsonl:2: expected an object with a 'prompt' field, got list",
        ),
        (['{"prompt": null, "answer": "2"}'], "x.jsonl:1: 'prompt' must be a non-empty string, got None"),
        (['{"prompt": 12, "answer": "2"}'], "x.jsonl:1: 'prompt' must be a non-empty string, got 12"),
    ]:
        (tmp_path / "x.jsonl").write_text("\n".join(lines) + "\n")
        rows = prompts.read_rows(str(tmp_path / "x.jsonl"))
        with pytest.raises(prompts.DataError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            prompts.encode(rows, lambda text: {"input_ids": [1]}, cfg, "x")


class _Store:
    """The c10d store's check/get, over a dict (the watchdog's verdict is pure bookkeeping)."""

    def __init__(self, values):
        self.values = {f"hybridrl/observe/progress/{r}": v.encode() for r, v in values.items()}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


@pytest.mark.fast
@pytest.mark.parametrize(
    "reports,expected",
    [  # rank: "<progress reports so far> <step> <phase>"
        (
            {0: "9 3 train", 1: "5 3 generate", 2: "9 3 train"},
            "Cause: rank 1 stalled in phase 'generate' of step 3 (the others wait for it in a collective).",
        ),
        ({0: "9 3 train", 1: "9 3 train", 2: "9 3 train"}, "every rank stopped in the same phase"),
        ({0: "9 3 train", 2: "9 3 train"}, "ranks [1] never reported (dead?)"),
    ],
)
def test_watchdog_verdict_names_the_rank_furthest_behind(reports, expected):
    from hybridrl.core import faults

    dog = faults.Watchdog(10, rank=0, size=3, run_dir=".")
    dog._store, dog.n, dog.step, dog.phase = _Store(reports), 9, 3, "train"
    assert dog.verdict().startswith(
        "rank 0 has made no progress for 0 s (train.watchdog_s=10), in phase 'train' of step 3"
    )
    assert expected in dog.verdict()
