"""The tool demo learns (slow: the warm-up is minutes on 2 cores): from a fresh warm-up
(examples/make_tool_demo_model.py), 20 steps of examples/recipes/tool-demo.yaml turn a model that
answers directly, and mostly wrongly, into one that calls the calculator on held-out prompts.
The README's commands run as a user runs them: through the `hybridrl` console script (which, unlike
`python -m`, does not put the working directory on the import path) from a fresh clone."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cli import tool_demo_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tool_demo_learns_to_call_the_calculator(tmp_path, monkeypatch):
    _, steps, summary = tool_demo_cli(
        tmp_path,
        monkeypatch,
        "--steps",
        "20",
        "--train.prompts_per_step",
        "16",
        "--rollout.n",
        "8",
        "--log.eval_size",
        "256",
        "--train.lr",
        "5e-5",
    )
    # seed 0 on the loaded CI machine: 6.2% -> 98.8% (README); greedy answers directly before training
    assert summary["heldout_acc_before"] < 0.2 and summary["heldout_acc_after"] > 0.8, summary
    assert steps[-1]["tools/calls_per_episode"] > steps[0]["tools/calls_per_episode"] + 0.2


def console_script(*args, cwd, timeout=120):
    """`hybridrl ARGS` as the installed console script runs it: sys.path[0] is the script's directory,
    not the working directory (here the checkout under test, so that its hybridrl is imported)."""
    code = (
        f"import sys; sys.path[0] = {str(ROOT)!r}; sys.argv = ['hybridrl', *{list(args)!r}]; "
        "from hybridrl.run.cli import main; sys.exit(main())"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_tool_demo_recipe_imports_its_environment_from_the_working_directory(tmp_path):
    """From a directory holding examples/ (as a fresh clone does), the recipe's env.cls
    examples.calculator_env:Calc imports through the console script, and a bad env.cls fails in the
    preflight, in one line, before any engine. Before: 'No module named examples' after 19 s of engine
    start-up, and env.cls was checked only then."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "runs" / "tool_demo" / "model").mkdir(parents=True)  # empty: models.inspect refuses it
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / "runs" / "tool_demo" / name).write_text('{"prompt": "123*45=", "answer": "5535"}\n')
    recipe = "examples/recipes/tool-demo.yaml"
    t0 = time.perf_counter()
    bad = console_script("train", "--config", recipe, "--env.cls", "examples.calculator_env:Nope", cwd=tmp_path)
    took = time.perf_counter() - t0
    lines = [x for x in (bad.stdout + bad.stderr).splitlines() if x.strip()]
    assert bad.returncode != 0 and lines == [
        "error: env.cls='examples.calculator_env:Nope': module 'examples.calculator_env' has no attribute 'Nope'"
    ], lines
    assert took < 15, took  # the preflight: ~1-2 s idle, before torch is imported
    ok = console_script("train", "--config", recipe, cwd=tmp_path)
    out = ok.stdout + ok.stderr
    assert ok.returncode != 0 and "env.cls" not in out and "runs/tool_demo/model" in out, out[-2000:]  # past it


@pytest.mark.slow
def test_readme_commands_from_a_fresh_clone(tmp_path):
    """The README's tool-demo commands from a fresh clone of this checkout, as written (the console
    script, relative paths): the warm-up, then the recipe for a few steps; and `hybridrl train --help`."""
    clone = tmp_path / "hybridrl"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    readme = (clone / "README.md").read_text()
    assert "python examples/make_tool_demo_model.py" in readme
    assert "hybridrl train --config examples/recipes/tool-demo.yaml" in readme
    assert console_script("train", "--help", cwd=clone).returncode == 0
    out = subprocess.run(
        [sys.executable, "examples/make_tool_demo_model.py"], cwd=clone, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = console_script(
        "train",
        "--config",
        "examples/recipes/tool-demo.yaml",
        "--steps",
        "2",
        "--log.eval_size",
        "16",
        "--log.run_dir",
        str(tmp_path / "run"),
        cwd=clone,
        timeout=1200,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
