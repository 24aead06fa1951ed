"""The examples run as shipped: the quickstart notebook in a real Jupyter kernel (nbclient), and
the accelerate script under `accelerate launch` at two CPU ranks. Both train a few steps only."""

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"train.prompts_per_step": 4, "rollout.n": 4, "log.eval_size": 16}


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = "STEPS = 3"  # what papermill would inject; the rest of the notebook runs as shipped
    train = next(c for c in nb.cells if "hybridrl.train(" in c.source)
    train.source = train.source.replace(
        "overrides={", "overrides={" + ", ".join(f"{k!r}: {v!r}" for k, v in SMALL.items()) + ", "
    )
    # Jupyter's and IPython's own state goes to the test's directory, not ~
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()  # raises on a failing cell
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "held-out accuracy before:" in text and "(3 steps," in text, text[-2000:]
    assert any("image/png" in o.get("data", {}) for o in nb.cells[-2].outputs)  # the report figure
    (run_dir,) = (tmp_path / "runs").iterdir()  # the notebook's cwd is where runs/ goes
    assert (run_dir / "report.png").exists()


def test_accelerate_example_runs_two_ranks(tmp_path):
    with socket.socket() as s:  # accelerate's default 29500 may be taken by another run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = {**SMALL, "train.steps": 2, "log.eval_every": 0, "log.run_dir": str(tmp_path / "run")}
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port),
        str(ROOT / "examples" / "accelerate_train.py"),
        *(f"{k}={v}" for k, v in overrides.items()),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert "2 ranks: held-out accuracy" in out.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
