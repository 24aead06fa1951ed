"""DeepSpeed's CPU Adam step at several ranks on one node, with 1 thread per rank (what torchrun's
OMP_NUM_THREADS=1 leaves it) vs the rank's share of the cores (what the trainer gives the step with
train.optimizer_offload: zero_engine.host_step_threads), side by side in one run.

Each rank is a process of its own with OMP_NUM_THREADS=1 and LOCAL_WORLD_SIZE set, as under torchrun,
holding DeepSpeedCPUAdam (the optimizer ZeRO-Offload steps on the host) over --params fp32 parameters
with gradients. The ranks step together (a barrier before each step, as their collectives keep them in
ZeRO) and the thread counts alternate step by step, so the machine's load hits every count alike. The
time is the slowest rank's, the median over --steps steps per count.

Run: python -m bench.cpu_adam_threads [--ranks 2] [--params 20000000] [--steps 7] [--threads 1,N]
(N: the share environ.optimizer_threads gives, cores // ranks). One row in bench/results/cpu_adam_threads.jsonl.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from bench.results import record


def _rank(rank: int, ranks: int, params: int, steps: int, threads: list[int], barrier, out) -> None:
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from hybridrl.core import environ

    environ.setup()
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(rank)
    sizes = [params // 4] * 3 + [params - 3 * (params // 4)]  # a few tensors, as a partition's groups are
    ps = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = DeepSpeedCPUAdam(ps, lr=1e-5, adamw_mode=True)
    with environ.omp_threads(max(threads)):
        opt.step()  # moments allocated and touched, so no step below pays for first-touch pages
    times: dict[int, list[float]] = {n: [] for n in threads}
    for _ in range(steps):
        for n in threads:
            with environ.omp_threads(n):
                barrier.wait()
                t0 = time.perf_counter()
                opt.step()
                times[n].append(time.perf_counter() - t0)
    out.put((rank, times))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--params", type=int, default=20_000_000, help="fp32 parameters per rank (its partition)")
    ap.add_argument("--steps", type=int, default=7, help="steps per thread count")
    ap.add_argument("--threads", default="", help="comma-separated counts (default: 1 and the rank's share)")
    args = ap.parse_args(argv)
    from hybridrl.core import environ

    share = environ.optimizer_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(args.ranks)})
    threads = sorted({int(x) for x in args.threads.split(",") if x} or {1, share})
    load_before = os.getloadavg()[0]  # the machine's other work: OpenMP's loops stall on a busy core
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, args.params, args.steps, threads, barrier, out))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    per_rank = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    # each step's time is its slowest rank's (the ranks meet in a collective after it)
    step_s = {
        n: statistics.median(max(per_rank[r][n][i] for r in per_rank) for i in range(args.steps)) for n in threads
    }
    base = step_s[1] if 1 in step_s else step_s[threads[0]]
    print(
        f"CPU Adam step, {args.ranks} ranks x {args.params / 1e6:g}M fp32 parameters, {environ.host_cores()} cores "
        f"(share: {share} thread(s) per rank); median of {args.steps} steps, slowest rank"
    )
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'threads/rank':>12} {'step s':>8} {'vs 1':>6} {'Gparam/s/rank':>14}")
    for n in threads:
        print(f"{n:>12} {step_s[n]:>8.3f} {base / step_s[n]:>5.2f}x {args.params / step_s[n] / 1e9:>14.3f}")
    figures = {
        "step_s": {str(n): round(s, 4) for n, s in step_s.items()},
        "speedup_vs_1": {str(n): round(base / s, 3) for n, s in step_s.items()},
        "share": share,
    }
    record(
        "cpu_adam_threads",
        {
            "ranks": args.ranks,
            "params_per_rank": args.params,
            "steps": args.steps,
            "threads": threads,
            "cores": environ.host_cores(),
        },
        figures,
        note="side by side in one run, thread counts alternating step by step",
        load_avg=[round(load_before, 1), round(os.getloadavg()[0], 1)],
    )
    return figures


if __name__ == "__main__":
    main()
