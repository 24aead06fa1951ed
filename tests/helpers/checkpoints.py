"""An uninterrupted run of N steps against one stopped at K and resumed to N (test_checkpoint,
test_faults, test_critic, test_lora, test_tensor_parallel)."""

import json
import subprocess
import sys
import time

from helpers.cli import train_cli

FAST = [
    "--train.prompts_per_step",
    "8",
    "--rollout.n",
    "4",
    "--log.eval_every",
    "0",
    "--log.eval_size",
    "16",
    "--train.probe_every",
    "0",
]


N, K = 4, 2  # the uninterrupted run's steps, and where the interrupted one stops


def _steps(records):
    return {r["step"]: r for r in records if "reward" in r}


def _resume_pair(root, *extra, kill_while_resuming=False):
    """An uninterrupted run of N steps, and one stopped at K (`--steps K`) then resumed to N
    (`kill_while_resuming`: after a first resume killed as it starts its engines)."""
    full, part = root / "full", root / "part"
    _, a, _ = train_cli(full, *FAST, *extra, "--steps", str(N))
    _, b1, _ = train_cli(part, *FAST, *extra, "--steps", str(K), "--ckpt.every", "1", "--ckpt.keep", "2")
    if kill_while_resuming:
        _kill_while_resuming(part, *FAST, *extra, "--steps", str(N), "--resume", str(part))
    out, b2, summary = train_cli(part, *FAST, *extra, "--steps", str(N), "--resume", str(part))
    return dict(full=full, part=part, a=_steps(a), b1=_steps(b1), b2=_steps(b2), out=out, summary=summary)


def _kill_while_resuming(run_dir, *args):
    """issue 40 (1): metrics.jsonl was emptied as the resumed run's log opened and refilled only after
    the engines, the checkpoint load and the probe; a kill -9 in between lost steps 1..K for good."""
    before = _steps(json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    written = (run_dir / "config.yaml").stat().st_mtime_ns
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridrl", "train", *args, "--log.run_dir", str(run_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and (run_dir / "config.yaml").stat().st_mtime_ns == written:
        time.sleep(0.05)  # the run log writes config.yaml, then opens metrics.jsonl, then the engines start
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    after = _steps(json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert after == before and sorted(after) == list(range(1, K + 1))


def _assert_same_steps(runs):
    a, b = runs["a"], runs["b2"]
    assert f"resuming from {runs['part'] / 'checkpoints' / f'step-{K}'}" in runs["out"].stdout
    assert sorted(b) == list(range(1, N + 1))  # metrics.jsonl continued: steps 1..K kept, K+1..N appended
    for s in range(1, N + 1):
        for key in ("loss", "reward", "grad_norm", "entropy_mean", "rollout_tokens"):
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])  # bit-identical
    lines = (runs["part"] / "metrics.jsonl").read_text().splitlines()
    assert sum("summary" in json.loads(x) for x in lines) == 1  # the first invocation's summary was dropped
    assert runs["summary"]["steps"] == N and runs["summary"]["heldout_acc_before"] is not None
