"""The code sandbox's cost: startup per program, and programs per second with several workers.

    python -m bench.sandbox                   # 60 programs per row; workers 1 and the machine's cores
    python -m bench.sandbox --programs 200 --workers 1,2,4

Rows, one workload at a time: `print(1)` run bare (`python -I -S`, no sandbox: an interpreter start),
then in a fresh jail (its interpreter, namespaces and root built, then the program: what each program
would cost without jails kept warm), then in a warm jail (hybridrl.sandbox.run: the program forked
from the jail's interpreter into namespaces and a /tmp of its own, rlimits, seccomp); then an
MBPP-style sample through the code_tests reward (the harness, three asserts): one at a time (its
latency: since issue 72 a checker and the solution's process, a round trip per call), then with
1..N workers in threads, each program its own sandbox. Medians of the single-program rows; the
throughput rows count programs finished over wall time; the CPU row counts CPU time of this process
and every process below it (the jails), which other jobs on the machine do not stretch. A row per run in
bench/results/sandbox.jsonl, with the 1-minute load average at the start (other jobs on the cores
stretch every figure here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench.results import record

SAMPLE = "```python\ndef add(a, b):\n    return a + b\n```"
ROW = {
    "prompt": "Write add(a, b).",
    "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"],
}


def cpu_s() -> float:
    """CPU seconds of this process and of every process below it, the reaped ones included (a live
    process's cutime holds what its reaped children used): what the jails spent, whatever else the
    machine's cores were doing. A jail closed in between loses its share (its processes are killed,
    not reaped up the tree), so none is closed between two readings."""
    tick, total = os.sysconf("SC_CLK_TCK"), sum(os.times()[:4])  # children: the jails closed so far
    todo = [str(os.getpid())]
    while todo:
        pid = todo.pop()
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                todo += open(f"/proc/{pid}/task/{tid}/children").read().split()
            except OSError:
                pass
        if pid != str(os.getpid()):
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15]) / tick  # utime, stime, cutime, cstime
            except OSError:
                pass
    return total


def bare(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "print(1)"], capture_output=True, check=True, env={})
        out.append(time.perf_counter() - t0)
    return out


def sandboxed(n: int, fresh: bool = False) -> list[float]:
    from hybridrl import sandbox

    out = []
    for _ in range(n):
        if fresh:
            sandbox.shutdown()  # the next run starts a jail
        res = sandbox.run("print(1)")
        assert res.ok, res.stderr
        out.append(res.wall_s)
    return out


def verdicts(n: int) -> list[float]:
    from hybridrl.data import code_tests

    answer = json.dumps({"code_tests": code_tests.spec_of(ROW)})
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert code_tests.code_tests("", SAMPLE, answer) == 1.0
        out.append(time.perf_counter() - t0)
    return out


def throughput(n: int, workers: int) -> float:
    from hybridrl.data import code_tests

    answer = json.dumps({"code_tests": code_tests.spec_of(ROW)})
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        scores = list(pool.map(lambda _: code_tests.code_tests("", SAMPLE, answer), range(n)))
    assert all(s == 1.0 for s in scores), scores
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=60)
    ap.add_argument("--workers", default=f"1,{os.cpu_count() or 1}")
    args = ap.parse_args()
    from hybridrl import sandbox
    from hybridrl.data import code_tests  # noqa: F401  first: jails started from here on preload its harness

    why = sandbox.available()
    if why:
        raise SystemExit(why)
    n = args.programs
    load = os.getloadavg()[0]
    b, f = bare(n), sandboxed(n, fresh=True)
    sandbox.run("print(1)")  # a jail started outside the timing
    c0 = cpu_s()
    s = sandboxed(n)
    c1 = cpu_s()
    v = verdicts(n)
    c2 = cpu_s()
    print(f"{n} programs a row, {os.cpu_count()} cores, load {load:.1f}")
    print(f"{'what':>44} {'median ms':>10} {'programs/s':>11}")
    for what, walls in (
        ("print(1), bare python -I -S", b),
        ("print(1), a fresh jail", f),
        ("print(1), a warm jail", s),
        ("code_tests, 3 asserts, one sample", v),
    ):
        print(f"{what:>44} {statistics.median(walls) * 1e3:>10.1f} {1 / statistics.median(walls):>11.1f}")
    cpu = f"{(c1 - c0) / n * 1e3:.1f} and {(c2 - c1) / n * 1e3:.1f}"
    print(f"{'CPU ms a program: print(1) warm, a code_tests sample':>44} {cpu}")
    rates = {}
    for w in (int(x) for x in args.workers.split(",")):
        rates[w] = throughput(n, w)
        print(f"{f'code_tests, 3 asserts, {w} worker(s)':>44} {'':>10} {rates[w]:>11.1f}")
    record(
        "sandbox",
        {"programs": n, "workers": sorted(rates)},
        {
            "bare_ms": round(statistics.median(b) * 1e3, 1),
            "fresh_jail_ms": round(statistics.median(f) * 1e3, 1),
            "sandbox_ms": round(statistics.median(s) * 1e3, 1),
            "code_tests_ms": round(statistics.median(v) * 1e3, 1),
            "sandbox_cpu_ms": round((c1 - c0) / n * 1e3, 1),
            "code_tests_cpu_ms": round((c2 - c1) / n * 1e3, 1),
            "programs_per_s": {str(w): round(r, 1) for w, r in rates.items()},
        },
        load=round(load, 1),
    )


if __name__ == "__main__":
    main()
