"""`make gpu-check` on a machine without CUDA: the plumbing runs, every GPU claim is listed as
unmeasured, the rows are recorded (and written to --out) and the exit code is 0 (python -m bench.gpu_check)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_without_cuda_lists_every_claim_unmeasured(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**_env(), "CUDA_VISIBLE_DEVICES": "", "HYBRIDRL_BENCH_RESULTS": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    from bench import gpu_check

    claims = [c for name, (_, cs) in gpu_check.CLAIMS.items() if name != "stack" for c, _ in cs]
    unmeasured = [r["claim"] for r in rows if r["verdict"] == "unmeasured"]
    assert unmeasured == claims and all(
        r["value"] == "unmeasured (no CUDA)" for r in rows if r["verdict"] == "unmeasured"
    )
    stack = next(r for r in rows if r["claim"] == "software stack")
    assert "torch" in stack["value"] and "deepspeed" in stack["value"]
    assert "| expandable | fragmentation case" in proc.stdout
    recorded = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert len(recorded) == 1 and recorded[0]["figures"]["rows"] == rows
    assert recorded[0]["figures"]["unmeasured"] == len(claims) and recorded[0]["workload"]["cuda"] is False


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


@pytest.mark.fast
def test_cuda_arch_list_made_parsable_for_deepspeed():
    """CUDA images set TORCH_CUDA_ARCH_LIST with architecture suffixes ('9.0a'), which DeepSpeed's
    JIT builder cannot parse (it stopped the trainer on the H100 image): environ.setup strips them."""
    from hybridrl.core.environ import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0 9.0a+PTX") == "8.0;9.0+PTX"
    assert deepspeed_arch_list("7.5;8.6;8.6") == "7.5;8.6"
