"""The run's appended files (journal.py, progress.RunLog): a resume never loses the rows up to its
checkpoint and never repeats the steps it replays; a full disk drops rows (counted), not the run;
dead letters stop growing at their cap. No engines: seconds."""

import errno
import json
import os

import pytest
import torch

from hybridrl.core import config as C
from hybridrl.core.journal import Journal, keep_upto
from hybridrl.core.launch import World
from hybridrl.observe.progress import RunLog

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

WORLD = World(0, 1, 0, torch.device("cpu"))


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _metrics(step):
    return {"reward": 0.5, "rollout_tok_s": 100.0, "elapsed_s": 1.0, "step_metric": step}


def _first_run(run_dir, steps, tensorboard=False):
    """A run that logged `steps` steps, samples at 0 and every second step, dead letters, a summary."""
    cfg = C.load(None, {"log.run_dir": str(run_dir), "train.steps": steps, "log.tensorboard": tensorboard})
    run = RunLog(cfg, WORLD)
    for s in range(1, steps + 1):
        run.step(s, _metrics(s))
        if s % 2 == 0:
            run.samples(s, [{"prompt": "p", "completion": "c", "answer": "a", "reward": 1.0}])
    run.close({"heldout_acc_before": None, "heldout_acc_after": None, "steps": steps, "minutes": 0.1})
    for name in ("reward_dead_letter.jsonl", "env_dead_letter.jsonl"):
        Journal(run_dir / name).write(*({"step": s, "kind": "error"} for s in range(1, steps + 1)), {"step": None})
    return cfg


def test_a_crash_while_resuming_keeps_every_row_up_to_the_checkpoint(tmp_path):
    """issue 40 (1, 4): metrics.jsonl was reopened with "w" and its rows written back only after the
    engines, the checkpoint load and the probe; a kill in between lost steps 1..N for good."""
    run_dir = tmp_path / "run"
    cfg = _first_run(run_dir, 6)
    RunLog(cfg, WORLD, resume_step=4)  # the resumed run opens its log ... and is killed (nothing closed)
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]  # 5, 6 are replayed next
    run = RunLog(cfg, WORLD, resume_step=4)  # resumed again; this time it runs to the end
    for s in (5, 6):
        run.step(s, _metrics(s))
        if s % 2 == 0:
            run.samples(s, [{"prompt": "p", "completion": "c", "answer": "a", "reward": 1.0}])
    run.close({"heldout_acc_before": None, "heldout_acc_after": None, "steps": 6, "minutes": 0.1})
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3, 4, 5, 6] and "summary" in rows[-1]
    assert [r["step_metric"] for r in rows[:-1]] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in _rows(run_dir / "samples.jsonl")] == [2, 4, 6]  # 6 once, not twice
    for name in ("reward_dead_letter.jsonl", "env_dead_letter.jsonl"):  # the replayed steps' entries went
        assert [r["step"] for r in _rows(run_dir / name)] == [1, 2, 3, 4, None]


def test_a_resume_does_not_repeat_tensorboard_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cfg = _first_run(run_dir, 4, tensorboard=True)
    run = RunLog(cfg, WORLD, resume_step=2)
    for s in (3, 4):
        run.step(s, {**_metrics(s), "reward": 1.0})
    run.close({"heldout_acc_before": None, "heldout_acc_after": None, "steps": 4, "minutes": 0.1})
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("reward")]
    assert got == [(1, 0.5), (2, 0.5), (3, 1.0), (4, 1.0)]


def test_keep_upto_cuts_in_place_or_rewrites_atomically(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "cut sh')
    inode = p.stat().st_ino
    assert keep_upto(p, 2) == 2 and _rows(p) == [{"step": 1}, {"step": 2}]
    assert p.stat().st_ino == inode  # the head was kept: truncated, nothing rewritten
    p.write_text('{"step": 1}\n{"summary": {}}\n{"step": 2}\n')  # a row to keep after one to drop
    assert keep_upto(p, 5) == 1 and _rows(p) == [{"step": 1}, {"step": 2}]
    assert not list(tmp_path.glob("*.tmp")) and keep_upto(tmp_path / "absent.jsonl", 1) == 0


def test_a_full_disk_drops_rows_not_the_run(tmp_path, monkeypatch, caplog):
    """issue 40 (4): ENOSPC writing metrics, samples or dead letters stopped the run."""
    cfg = C.load(None, {"log.run_dir": str(tmp_path / "run"), "train.steps": 3})
    run = RunLog(cfg, WORLD)
    run.step(1, _metrics(1))
    real_write, full = os.write, [True]

    def write(fd, data):
        if full[0]:
            real_write(fd, data[:7])  # a row cut short, as a disk filling mid-write leaves it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    run.step(2, _metrics(2))
    run.samples(2, [{"prompt": "p", "completion": "c", "answer": "a", "reward": 1.0}])
    dead = Journal(tmp_path / "run" / "reward_dead_letter.jsonl", 1 << 20)
    assert not dead.write({"step": 2}) and dead.dropped == 1
    full[0] = False  # space came back
    run.step(3, _metrics(3))
    run.close({"heldout_acc_before": None, "heldout_acc_after": None, "steps": 3, "minutes": 0.1})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ok = [json.loads(x) for x in lines if x.startswith("{") and x.endswith("}")]
    assert [r["step"] for r in ok if "step" in r] == [1, 3] and ok[-1]["summary"]["log_rows_dropped"] == 2
    from hybridrl.observe import report

    assert [r["step"] for r in report.load(tmp_path / "run").steps] == [1, 3]  # the torn row is skipped
    said = [r.message for r in caplog.records if "No space left on device" in r.message]
    assert len(said) == 3  # once per file (metrics, samples, the dead letter), not once per row


def test_dead_letters_stop_at_their_cap(tmp_path):
    j = Journal(tmp_path / "dead.jsonl", cap_bytes=1000)
    for i in range(100):
        j.write({"step": i, "error": "x" * 80})
    assert 1000 <= (tmp_path / "dead.jsonl").stat().st_size < 1100 and j.dropped == 100 - len(_rows(j.path))


def raises(prompt, completion, answer):
    raise RuntimeError("verifier bug")


def test_reward_dead_letters_survive_a_full_disk_and_stop_at_the_cap(tmp_path, monkeypatch):
    from hybridrl.data import rewards

    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    monkeypatch.setattr(rewards, "DEAD_LETTER_CAP", 2000)
    scorer = rewards.Scorer(C.load(None, {"reward.fn": "test_journal:raises", "reward.workers": 0}).reward)
    scorer.run_dir = tmp_path
    assert scorer.score(["p"] * 50, ["c"] * 50, ["a"] * 50) == [0.0] * 50  # every one raised: scored 0
    assert scorer.counts()["reward_errors"] == 50
    size = (tmp_path / "reward_dead_letter.jsonl").stat().st_size
    assert 2000 <= size < 2500 and scorer._dead_letter.dropped > 0  # capped, the rest counted

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rewards, "DEAD_LETTER_CAP", 1 << 20)
    scorer._dead_letter = None
    monkeypatch.setattr(os, "write", full)
    assert scorer.score(["p"], ["c"], ["a"]) == [0.0]  # a full disk: counted, the run goes on
    scorer.close()
