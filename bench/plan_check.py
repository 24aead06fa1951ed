"""The memory plan's training phase against the trainer's measured peak, on CPU.

    python -m bench.plan_check   # 134m and 0.5b, checkpointing off/on, 1 rank ZeRO-2, 2 ranks ZeRO-3
    python -m bench.plan_check --shapes 134m --runs 1:2,1:3,2:2,2:3 --tokens 1024
    # long answers
    python -m bench.plan_check --shapes 0.5b --runs 1:2 --ckpt-modes on --seqs 1 --tokens 4096,8192,16384
    python -m bench.plan_check --replan --shapes 0.5b --runs 1:2 --ckpt-modes on --seqs 1 --tokens 1024,4096,8192,16384
    python -m bench.plan_check --shapes 134m --runs 2:2 --sp 2 --ckpt-modes on --seqs 1 --tokens 4096,8192   # Ulysses

Each row is one process group (torch.distributed.run for 2 ranks) that builds the real trainer
(DeepSpeed ZeRO, the shape's random weights from bench/shapes.py) and runs two updates on one
micro-batch of --tokens tokens (the first creates Adam's moments): --seqs sequences of equal length
(4; 1 for one long sequence, as a long answer trains). With --sp N (train.sequence_parallel_size) each
rank brings its --seqs sequences and the group trains them as one micro-batch, each rank computing its
--tokens share of the group's tokens, which is what the plan counts. On CPU every term of the plan
lives in host memory, so the measured figure is rank 0's resident-memory high-water mark during
the second update, less what the process held before the model was loaded (torch, DeepSpeed and
transformers imported), with glibc's default heap (HYBRIDRL_HOST_HEAP=default: freed tensors go
back to the system, so resident memory follows live tensors); the plan's figure is its `train`
column less the reserve (plan.build on the same settings). The weights are random: only their
shapes matter here. `measure(..., cuda=True)` and `planned(..., on_cpu=False)` are the same
comparison on a GPU (bench/lease.py): the device's torch.cuda.max_memory_allocated during the
second update against the GPU plan's train column.
With --replan nothing is measured: today's plan is set against the newest recorded measurement of
each row (a measured peak does not depend on the plan's code).
Results: the table, and a row in bench/results/plan_check.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    """One rank: build the trainer, two updates, print rank 0's figures as JSON."""
    import torch

    from hybridrl.core import config, launch, memory
    from hybridrl.data.batch import Batch
    from hybridrl.engines.trainer import Trainer  # DeepSpeed and transformers imported: not the plan's to count

    world = launch.init_distributed()
    device = world.device if args.cuda else torch.device("cpu")
    base = torch.cuda.memory_allocated() if args.cuda else memory.host_memory()[0]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    cfg = config.load(
        None,
        {
            "model.gradient_checkpointing": args.ckpt,
            "train.zero_stage": args.zero,
            "train.max_tokens_per_micro_batch": args.tokens,
            "train.minibatches": 1,
            "model.dtype": args.dtype,
            "train.lr": 1e-6,
            "train.sequence_parallel_size": args.sp,
        },
    )
    trainer = Trainer(cfg, args.model, device=device, dtype=dtype, attn_implementation="sdpa")
    rows, length = args.seqs, args.tokens // args.seqs  # one micro-batch of exactly --tokens tokens
    g = torch.Generator().manual_seed(world.rank)
    vocab = trainer.hf.config.vocab_size
    prompts = [torch.randint(0, vocab, (length // 2,), generator=g).tolist() for _ in range(rows)]
    completions = [torch.randint(0, vocab, (length - length // 2,), generator=g).tolist() for _ in range(rows)]
    batch = Batch.from_rows(prompts, completions, [[-1.0] * len(c) for c in completions], [1.0, -1.0, 0.5, -0.5])
    batch.logp_old = None
    trainer.step(batch)  # Adam's moments exist from here on
    if args.cuda:  # on a GPU every term of the plan is device memory the allocator hands out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.step(batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        memory.reset_peak()
        trainer.step(batch)
        peak = memory.peak_since_reset()
    if world.main:
        print("RESULT " + json.dumps({"peak": peak - base}), flush=True)


def measure(
    shape_dir: str,
    ranks: int,
    zero: int,
    ckpt: bool,
    tokens: int,
    dtype: str,
    cuda: bool = False,
    timeout: float = 1800,
    seqs: int = 4,
    sp: int = 1,
) -> float:
    cmd = (
        [
            sys.executable,
            "-m",
            "bench.plan_check",
            "--worker",
            "--model",
            shape_dir,
            "--zero",
            str(zero),
            "--tokens",
            str(tokens),
            "--dtype",
            dtype,
            "--seqs",
            str(seqs),
            "--sp",
            str(sp),
        ]
        + (["--ckpt"] if ckpt else [])
        + (["--cuda"] if cuda else [])
    )
    if ranks > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(29500 + os.getpid() % 1000),
        ] + cmd[1:]  # its -m: each rank runs bench.plan_check as a module
    env = {**os.environ, "HYBRIDRL_HOST_HEAP": "default"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(
            f"exit {out.returncode} (-9: killed, out of memory?)\n" + out.stdout[-2000:] + out.stderr[-3000:]
        )
    return json.loads(lines[-1][7:])["peak"]


TRAINER_ROWS = ("trainer params", "trainer grads", "fp32 master + Adam", "activations", "ZeRO-3 gathered")


def planned(
    shape_dir: str,
    ranks: int,
    zero: int,
    ckpt: bool,
    tokens: int,
    dtype: str,
    on_cpu: bool = True,
    seqs: int = 4,
    sp: int = 1,
) -> int:
    """The plan's train column, the trainer's rows alone: no vLLM engine in the measured process, and
    the reserve (rollout.memory_margin_mb) is not the allocator's."""
    from hybridrl.core import config
    from hybridrl.cycle import plan
    from hybridrl.cycle.shape import Shape, read_config

    cfg = config.load(
        None,
        {
            "model.gradient_checkpointing": ckpt,
            "train.zero_stage": zero,
            "model.dtype": dtype,
            "train.max_tokens_per_micro_batch": tokens,
            "rollout.max_model_len": tokens // seqs,
            "train.sequence_parallel_size": sp,
        },
    )
    shape = Shape.from_config(read_config(shape_dir))
    k = plan.knobs(cfg, shape, world=ranks, local=ranks, on_cpu=on_cpu)
    p = plan.build(shape, k, device=1 << 50, host=1 << 50)
    return sum(row.get("train", 0) for name, row in p.rows.items() if name in TRAINER_ROWS)


def grid(args):
    """(shape, its directory, ranks, ZeRO stage, tokens, checkpointing) for each row asked for."""
    from bench import shapes

    for name in args.shapes.split(","):
        path = str(shapes.build(name))
        for ranks, zero in (map(int, run.split(":")) for run in args.runs.split(",")):
            for n in (int(t) for t in args.tokens.split(",")):
                for ckpt in (mode == "on" for mode in args.ckpt_modes.split(",")):
                    yield name, path, ranks, zero, n, ckpt


def replan(args) -> None:
    """Today's plan beside the newest recorded measurement of each row asked for: a measured peak
    does not depend on the plan's code, so a change to the plan's arithmetic is checked against the
    measurements already made (each row keeps the commit and date it was measured at)."""
    from bench.results import load

    dtype = args.dtype or "bfloat16"
    measured = {}
    for r in load("plan_check"):  # oldest first: the newest of each row wins
        w = r["workload"]
        if w.get("replanned") or w.get("seqs", 4) != args.seqs or w.get("dtype") != dtype or w.get("sp", 1) != args.sp:
            continue
        for x in r["figures"]["rows"]:
            if x.get("measured"):
                key = (x["shape"], x["ranks"], x["zero"], x["ckpt"], x.get("tokens", w.get("tokens")))
                measured[key] = dict(x, tokens=key[-1], measured_commit=r["commit"], measured_date=r["date"])
    print(f"today's plan against the newest measurement of each row ({dtype}, {args.seqs} sequence(s) per micro-batch)")
    print(
        f"{'shape':>6} {'ranks':>5} {'ZeRO':>4} {'ckpt':>5} {'tokens':>6} {'plan GiB':>9} {'measured GiB':>13} "
        f"{'measured/plan':>14}  measured at"
    )
    rows = []
    for name, path, ranks, zero, n, ckpt in grid(args):
        m = measured.get((name, ranks, zero, ckpt, n))
        if m is None:
            print(f"{name:>6} {ranks:>5} {zero:>4} {'on' if ckpt else 'off':>5} {n:>6}  never measured")
            continue
        m["plan"] = planned(path, ranks, zero, ckpt, n, dtype, seqs=args.seqs, sp=args.sp)
        rows.append(m)
        print(
            f"{name:>6} {ranks:>5} {zero:>4} {'on' if ckpt else 'off':>5} {n:>6} {m['plan'] / 2**30:>9.2f} "
            f"{m['measured'] / 2**30:>13.2f} {m['measured'] / m['plan']:>14.2f}  "
            f"{m['measured_commit']} {m['measured_date'][:16]}",
            flush=True,
        )
    record(
        "plan_check",
        {
            "shapes": args.shapes.split(","),
            "runs": args.runs.split(","),
            "tokens": [r["tokens"] for r in rows],
            "seqs": args.seqs,
            "dtype": dtype,
            "replanned": True,
        },
        {"rows": rows},
        **({"note": args.note} if args.note else {}),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model", default="")
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--cuda", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", default="1024", help="tokens of the micro-batch; several: comma-separated")
    ap.add_argument("--seqs", type=int, default=4, help="sequences in the micro-batch, of equal length")
    ap.add_argument("--sp", type=int, default=1, help="train.sequence_parallel_size (ranks must be a multiple)")
    ap.add_argument("--ckpt-modes", default="off,on", help="gradient checkpointing: off, on or both")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--shapes", default="134m,0.5b")
    ap.add_argument("--runs", default="1:2,2:3", help="ranks:zero_stage pairs")
    ap.add_argument("--note", default="", help="kept with the results row (the machine's load, say)")
    ap.add_argument(
        "--replan",
        action="store_true",
        help="no new measurement: today's plan against the newest "
        "recorded measurement of each row asked for (the plan changed, the trainer did not)",
    )
    args = ap.parse_args()
    if args.worker:
        args.tokens = int(args.tokens)
        return worker(args)
    if args.replan:
        return replan(args)
    from hybridrl.core import environ

    dtype = args.dtype or ("bfloat16" if environ.fast_bf16() else "float32")
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    tokens = [int(t) for t in args.tokens.split(",")]
    print(
        f"trainer peak on CPU vs the plan: {cpu}, {dtype}, one micro-batch of {args.tokens} tokens in "
        f"{args.seqs} sequence(s), {date.today()}"
    )
    print(
        f"{'shape':>6} {'ranks':>5} {'ZeRO':>4} {'ckpt':>5} {'tokens':>6} {'plan GiB':>9} {'measured GiB':>13} "
        f"{'measured/plan':>14}"
    )
    results = []
    for name, path, ranks, zero, n, ckpt in grid(args):
        p = planned(path, ranks, zero, ckpt, n, dtype, seqs=args.seqs, sp=args.sp)
        try:
            m = measure(path, ranks, zero, ckpt, n, dtype, seqs=args.seqs, sp=args.sp)
        except RuntimeError as e:  # one row's failure (a worker killed for memory) keeps the others
            results.append(
                dict(
                    shape=name,
                    ranks=ranks,
                    zero=zero,
                    ckpt=ckpt,
                    tokens=n,
                    plan=p,
                    measured=None,
                    error=str(e).splitlines()[0],
                )
            )
            print(
                f"{name:>6} {ranks:>5} {zero:>4} {'on' if ckpt else 'off':>5} {n:>6} {p / 2**30:>9.2f} "
                f"{str(e).splitlines()[0]}",
                flush=True,
            )
            continue
        results.append(dict(shape=name, ranks=ranks, zero=zero, ckpt=ckpt, tokens=n, plan=p, measured=m))
        print(
            f"{name:>6} {ranks:>5} {zero:>4} {'on' if ckpt else 'off':>5} {n:>6} {p / 2**30:>9.2f} "
            f"{m / 2**30:>13.2f} {m / p:>14.2f}",
            flush=True,
        )
    record(
        "plan_check",
        {
            "shapes": args.shapes.split(","),
            "runs": args.runs.split(","),
            "tokens": tokens[0] if len(tokens) == 1 else tokens,
            "seqs": args.seqs,
            "dtype": dtype,
            **({"sp": args.sp} if args.sp > 1 else {}),
        },
        {"rows": results},
        **({"note": args.note} if args.note else {}),
    )


if __name__ == "__main__":
    main()
