"""python -m scripts.lease without a GPU: the plan of calls fits the lease, the dry run writes every stage's
rows where the device tool fetches them from, and a stage cut short keeps the rows it printed; the
command issue 51 names from before the move to scripts/, `python -m bench.lease`, still runs it."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import lease

ROOT = Path(__file__).resolve().parents[1]


def _no_cuda(out: Path) -> dict:
    """No GPU; the run's row recorded under $OUT/results, as the lease's calls set it."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HYBRIDRL_BENCH_RESULTS": str(out / "results")}


@pytest.mark.fast
def test_plan_of_calls_fits_the_lease_and_carries_one_part_a_call(capsys):
    calls = lease.calls()
    assert [c for c in calls[0].carry if "site.part" in c] == [".gpu_wheels/site.part0"]
    assert [c for c in calls[1].carry if "site.part" in c] == [".gpu_wheels/site.part1"]
    assert "install.sh" in calls[1].command and "python3 -m hybridrl.env" in calls[1].command
    assert all(len(c.command) <= 2000 and c.timeout_s <= 600 for c in calls)  # the device tool's limits
    assert sum(s for _, s in lease.budget(calls)) <= lease.LEASE_S
    assert lease.print_plan() == 0
    printed = capsys.readouterr().out
    assert "call 3: run(timeout_s=" in printed and "give_back" in printed and "within 810 s" in printed


@pytest.mark.fast
def test_bench_lease_is_the_moved_module():
    assert importlib.import_module("bench.lease") is lease


def test_the_old_command_runs_the_moved_script():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.lease", "--plan"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "call 3: run(timeout_s=" in proc.stdout and "python3 -m scripts.lease" in proc.stdout


def test_dry_run_writes_every_stage_to_out(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.lease", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_no_cuda(tmp_path),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "lease.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} == set(lease.BY_NAME)
    for s in lease.STAGES:
        if s.cuda:
            assert [r["value"] for r in rows if r["stage"] == s.name] == ["skipped: no CUDA"]
    assert any(r["claim"] == "software stack" and "torch" in r["value"] for r in rows)
    # the plan side runs anywhere: four trainer cases, checkpointing planned below no checkpointing
    plans = {
        r["claim"].split(", ZeRO")[0]: r["data"]["plan_gib"]
        for r in rows
        if r["stage"] == "trainer_plan" and "plan_gib" in r.get("data", {})
    }
    assert len(plans) == 4
    for shape in ("0.5b", "1.5b"):
        on, off = (plans[f"trainer peak, {shape}, gradient checkpointing {x}"] for x in ("on", "off"))
        assert 0 < on < off
    decode = [r["data"]["plan_gib"] for r in rows if r["stage"] == "decode7b" and "plan_gib" in r.get("data", {})]
    assert decode[0]["CUDA graphs"] == 0 < decode[1]["CUDA graphs"]
    # issue 47's stages: each decision checked here, its GPU effect skipped
    verdicts = [
        (r["stage"], r["verdict"])
        for r in rows
        if r["stage"] in ("allreduce", "tp_seqs", "tp_rng") and "wall time" not in r["claim"]
    ]
    assert sorted(verdicts) == [
        ("allreduce", "pass"),
        ("tp_rng", "pass"),
        ("tp_rng", "skipped"),
        ("tp_seqs", "pass"),
        ("tp_seqs", "skipped"),
    ], verdicts
    asleep = [r["data"]["plan_gib"] for r in rows if r["stage"] == "asleep" and "plan_gib" in r.get("data", {})]
    assert len(asleep) == 1 and asleep[0]["CUDA graphs"] > 0 and asleep[0]["buffers"] > 0
    # the mixture-of-experts decode: vLLM holds all 128 experts (57 GiB), its activations go by the 3.35B active
    moe = [r["data"]["plan_gib"] for r in rows if r["stage"] == "moe_decode" and "plan_gib" in r.get("data", {})]
    assert len(moe) == 2 and moe[0]["CUDA graphs"] == 0 < moe[1]["CUDA graphs"]
    assert 56 < moe[0]["weights"] < 57 and moe[0]["activations"] < 2 < moe[0]["weights"] / 10
    table = (tmp_path / "lease.md").read_text()
    assert table.count("\n| ") == len(rows) + 1  # the header and one line a row
    recorded = [json.loads(x) for x in (tmp_path / "results" / "lease.jsonl").read_text().splitlines()]
    assert len(recorded) == 1 and recorded[0]["figures"]["rows"] == rows  # the call's run, for bench/results/
    assert "gpu" not in recorded[0]["machine"] and recorded[0]["workload"]["device"] == "no CUDA (dry run)"
    assert len(list(tmp_path.iterdir())) <= 8  # the device tool brings back at most 8 files


def test_a_call_short_of_time_leaves_the_stage_for_the_next(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.lease", "--stages", "trainer_plan", "--left", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_no_cuda(tmp_path),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "lease.jsonl").read_text().splitlines()]
    assert [r["verdict"] for r in rows] == ["later"] and "next call" in rows[0]["value"]


def test_a_stage_cut_short_keeps_the_rows_it_printed(tmp_path):
    rows = lease.Rows(tmp_path, "test")
    printed = "ROW " + json.dumps({"claim": "first", "value": "1", "target": "", "verdict": "info", "data": {}})
    argv = [sys.executable, "-c", f"import time; print({printed!r}, flush=True); time.sleep(60)"]
    stage = lease.Stage("slow", timeout=100, least=1, cuda=False, what="prints a row, then hangs")
    assert lease.run_stage(stage, 1.5, rows, tmp_path / "lease.log", argv=argv) == "cut"  # the call's time, not its own
    got = [json.loads(x) for x in (tmp_path / "lease.jsonl").read_text().splitlines()]
    assert [r["claim"] for r in got] == ["first", "slow: stage"] and got[1]["verdict"] == "cut"


@pytest.mark.fast
def test_gpu_check_variants_name_eager_decoding_now_that_graphs_are_the_gpu_default():
    """CUDA graphs became the GPU default (recipe.resolve): a variant without --rollout.enforce_eager
    decodes with graphs, so the 'eager' ones must ask for it or the check compares graphs with graphs."""
    from bench import gpu_run_checks

    for name, args in gpu_run_checks.VARIANTS.items():
        assert ("--rollout.enforce_eager" in args) == ("eager" in name), name
    assert sum("--rollout.enforce_eager" not in a for a in gpu_run_checks.VARIANTS.values()) == 1


@pytest.mark.fast
def test_rows_name_paths_in_the_checkout_as_the_repository_does(tmp_path):
    """The rows are committed (bench/results/lease.jsonl): a path inside the lent machine's checkout is
    written relative to it, as a user's clone names it."""
    rows = lease.Rows(tmp_path, "test")
    rows.add(
        "prepare",
        {
            "claim": "weights",
            "value": f"{lease.ROOT}/.cache/shapes/0.5b (3 s)",
            "verdict": "info",
            "data": {"tail": f"File {lease.ROOT}/hybridrl/x.py"},
        },
    )
    got = json.loads((tmp_path / "lease.jsonl").read_text())
    assert got["value"] == ".cache/shapes/0.5b (3 s)" and got["data"]["tail"] == "File hybridrl/x.py"
    assert rows.rows[0]["value"] == got["value"] and str(lease.ROOT) not in (tmp_path / "lease.md").read_text()
