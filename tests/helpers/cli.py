"""The CLI users run, in a subprocess: a short training run and its metrics, an export, the tool demo."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SMALL = [
    "--steps",
    "3",
    "--train.prompts_per_step",
    "8",
    "--rollout.n",
    "4",
    "--log.eval_every",
    "0",
    "--log.eval_size",
    "16",
    "--train.lr",
    "1e-4",
    "--train.probe_every",
    "1",
]  # every hand-off checked


def train_cli(run_dir, *args, timeout=600):
    cmd = [sys.executable, "-m", "hybridrl", "train", *SMALL, "--log.run_dir", str(run_dir), *args]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in records if "reward" in r], records[-1]["summary"]


def export_cli(run_dir, out_dir, *flags, ok=True):
    """`hybridrl export RUN OUT [flags]`; asserts it succeeded unless ok=False (a refusal test)."""
    res = subprocess.run(
        [sys.executable, "-m", "hybridrl", "export", str(run_dir), str(out_dir), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0 or not ok, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def tool_demo_cli(tmp_path, monkeypatch, *flags):
    """The README's tool demo: make its model and data, then `hybridrl train --config
    examples/recipes/tool-demo.yaml` on them with `flags`; returns train_cli's (out, steps, summary)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_tool_demo_model.py"), "--out", str(tmp_path / "td")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    monkeypatch.chdir(ROOT)  # the recipe names examples.calculator_env:Calc
    return train_cli(
        tmp_path / "run",
        "--config",
        str(ROOT / "examples" / "recipes" / "tool-demo.yaml"),
        "--model",
        str(tmp_path / "td" / "model"),
        "--data",
        str(tmp_path / "td" / "train.jsonl"),
        "--data.heldout_path",
        str(tmp_path / "td" / "heldout.jsonl"),
        *flags,
    )
