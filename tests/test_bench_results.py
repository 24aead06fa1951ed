"""bench/results.py (one JSON line per run in bench/results/<bench>.jsonl), bench/render.py (tables in
README.md and docs/ made from them) and every bench module's `python -m bench.<name> --help`. Fast:
no engines start."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench import render, results

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

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "bench.results", *a], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
        )

    assert "toy.jsonl: 1 rows" in run().stdout
    assert "the raw text" in run("toy", "--source", "toy-*", "--text").stdout
    assert run("toy", "--source", "other-*").returncode == 1


def _peers_row(date: str, hybridrl: float, trl: float, **machine) -> dict:
    return {
        "bench": "peers",
        "date": date,
        "commit": "abc1234",
        "machine": {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "flags": ["avx2"], "kind": "avx2", **machine},
        "versions": {},
        "workload": {"workload": "demo", "prompts": 16, "n": 8, "tokens": 4, "dtype": "float32"},
        "figures": {
            "trainers": {"hybridrl": {"step_s": hybridrl}, "TRL vLLM colocate": {"step_s": trl}},
            "speedup": trl / hybridrl,
            "target": 1.5,
        },
    }


def test_render_fills_a_marked_region_and_check_finds_it_stale(results_dir, tmp_path):
    results.append("peers", _peers_row("2026-11-25T10:00:00Z", 0.2, 0.3))
    results.append("peers", _peers_row("2026-11-26T10:00:00Z", 0.1, 0.25))  # newer: the table's row
    results.append(
        "demo_curve",
        {
            "bench": "demo_curve",
            "date": "2026-11-26",
            "machine": {"kind": "amx"},
            "workload": {"set": []},
            "figures": {
                "grid_s": [0, 10, 20],
                "acc": {"0": [0.2, 0.5, 0.8]},
                "mean": [0.2, 0.5, 0.8],
                "final": {"0": 0.81},
                "final_mean": 0.81,
                "time_to_75": {"0": 20.0},
                "mean_time_to_75": 20.0,
            },
        },
    )
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Speed\n\nbefore\n<!-- bench:peers -->\nhand-written, stale\n<!-- /bench:peers -->\nbetween\n"
        "<!-- bench:demo_curve every=20 -->\n<!-- /bench:demo_curve -->\n"
        "<!-- bench:history:peers kind=avx2 -->\n<!-- /bench:history:peers -->\nafter\n"
    )
    new, changed = render.rewrite(doc.read_text())
    assert changed == ["peers", "demo_curve every=20", "history:peers kind=avx2"]
    assert new.startswith("# Speed\n\nbefore\n<!-- bench:peers -->\n\n| workload") and "\nbetween\n" in new
    assert "hand-written" not in new and new.endswith("<!-- /bench:history:peers -->\nafter\n")
    assert (
        "| demo, 16 x 8 x 4 | float32 | Xeon avx2 | 2026-11-26 10:00 | abc1234 | 0.100 | - | 0.250 | **2.50x** |" in new
    )
    assert "| 0 | 20.0% | 20.0% |" in new and "| 20 | 80.0% | 80.0% |" in new and "| 10 |" not in new  # every=20
    assert new.count("\n- 2026-11-2") == 2 and new.index("2026-11-26 10:00, Xeon") < new.index("2026-11-25 10:00, Xeon")
    assert render.rewrite(new) == (new, [])  # rendering twice changes nothing

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "bench.render", *args, str(doc)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "HYBRIDRL_BENCH_RESULTS": str(results_dir)},
            timeout=60,
        )

    assert cli("--check").returncode == 1 and "hand-written" in doc.read_text()  # --check writes nothing
    assert cli().returncode == 0 and doc.read_text() == new
    assert cli("--check").returncode == 0
    doc.write_text(new + "<!-- bench:nonesuch -->\n<!-- /bench:nonesuch -->\n")
    out = cli("--check")
    assert out.returncode == 2 and "unknown renderer" in out.stderr


def test_the_repository_tables_are_current():
    """Every marked region in README.md and docs/ is what `python -m bench.render` makes of bench/results/:
    after recording a run, render the tables and commit both."""
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDRL_BENCH_RESULTS"}
    out = subprocess.run(
        [sys.executable, "-m", "bench.render", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_module_runs_as_a_module(name, tmp_path):
    """`python -m bench.<name> --help` from the repository root: the package imports without sys.path
    edits, and its --help (or, for a module without a command line, its docstring) exits 0. With an
    empty cache, as on a fresh clone: bench.real_model's --help fetched and converted the 538 MB model
    there (three minutes) before it had a command line."""
    env = {**os.environ, "HYBRIDRL_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()
    assert not (tmp_path / "cache" / "models").exists()


def test_no_bench_module_edits_sys_path():
    for name in BENCHES:
        assert "sys.path" not in (ROOT / "bench" / f"{name}.py").read_text(), name
