"""bench/results.py (one JSON line per run in bench/results/<bench>.jsonl) and every bench module's
`python -m bench.<name> --help`. Fast: no engines start."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench import results

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_BENCH_RESULTS", str(tmp_path))
    return tmp_path


def test_record_appends_one_line_a_run_and_load_reads_them_back(results_dir):
    first = results.record("toy", {"workload": "demo", "dtype": "float32"}, {"step_s": 0.1}, note="first")
    second = results.record("toy", {"workload": "demo", "dtype": "bfloat16"}, {"step_s": 0.09})
    lines = (results_dir / "toy.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == first
    assert results.load("toy") == [first, second]
    assert results.load("nothing-here") == []
    row = first
    assert list(row)[:7] == ["bench", "date", "commit", "machine", "versions", "workload", "figures"]
    assert row["note"] == "first" and "note" not in second
    assert row["date"].endswith("Z") and row["date"][:2] == "20"
    assert row["commit"] is None or len(row["commit"].split("+")[0]) >= 7
    m = row["machine"]
    assert m["cores"] >= 1 and m["kind"] and not {"host", "hostname", "node"} & set(m)
    assert not platform.node() or platform.node() not in json.dumps(row)  # no host name anywhere
    assert set(m["flags"]) <= set(results.CPU_FLAGS)
    assert row["versions"]["python"].count(".") == 2 and "torch" in row["versions"]
    with pytest.raises(ValueError, match="date"):
        results.record("toy", {}, {}, date="yesterday")  # the core fields are record's own


def test_load_by_source_pattern(results_dir):
    results.append("toy", {"bench": "toy", "source": "peers-demo-fp32-amx.txt", "text": "raw"})
    results.append("toy", {"bench": "toy", "source": "peers-134m-bf16-noamx.txt"})
    results.append("toy", {"bench": "toy"})
    assert [r["source"] for r in results.load("toy", source="peers-*-amx.txt")] == ["peers-demo-fp32-amx.txt"]
    assert len(results.load("toy", source="*")) == 2


def test_machine_kind_names_the_gpu_else_the_best_cpu_flag():
    assert results.kind({"gpu": "NVIDIA H100 80GB HBM3", "flags": ["amx_bf16"]}) == "H100"
    assert results.kind({"flags": ["amx_bf16", "avx512_bf16", "avx512f", "avx2"]}) == "amx"
    assert results.kind({"flags": ["avx512_bf16", "avx512f", "avx2"]}) == "avx512-bf16"
    assert results.kind({"flags": ["avx2"]}) == "avx2"
    assert results.kind({"flags": []}) == "cpu"


def test_no_gpu_when_cuda_visible_devices_is_empty(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "gpu" not in results.machine()


def test_results_cli_lists_and_prints_rows(results_dir):
    results.append("toy", {"bench": "toy", "date": "2026-11-25", "source": "toy-old.txt", "text": "the raw text"})
    env = {**os.environ, "HYBRIDRL_BENCH_RESULTS": str(results_dir)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "bench.results", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT, env=env, timeout=60)
    assert "toy.jsonl: 1 rows" in run().stdout
    assert "the raw text" in run("toy", "--source", "toy-*", "--text").stdout
    assert run("toy", "--source", "other-*").returncode == 1


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_module_runs_as_a_module(name):
    """`python -m bench.<name> --help` from the repository root: the package imports without sys.path
    edits, and its --help (or, for a module without a command line, its docstring) exits 0."""
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_no_bench_module_edits_sys_path():
    for name in BENCHES:
        assert "sys.path" not in (ROOT / "bench" / f"{name}.py").read_text(), name
