"""Host memory (RSS) per rank while the trainer, the reference and (optionally) the critic are
built and run one step: what a run holds in host RAM besides vLLM.

    python -m bench.host_memory                          # 2 ranks, ZeRO-3, bf16, a Qwen2.5-0.5B shape, reference on
    python -m bench.host_memory --ranks 1 --zero 2 --model demo --dtype float32

Each rank is a spawned process in one gloo group (as `--nproc` makes them). A sampler thread reads
/proc/self/status every 5 ms: `rss` is VmRSS (what the kernel charges the process, page-cache pages
of memory-mapped checkpoint files included), `private` is RssAnon (memory only this process holds:
parameter copies, optimizer states). Peaks are per stage. The model is bench/memory.py's
Qwen2.5-0.5B shape (494M parameters, random weights, bf16 safetensors, built once into the cache).

On CPU every engine's states live in host memory, so the sharded training states (fp32 master
weights and Adam moments, 12 bytes per parameter / ranks) are part of the figures; on a GPU they
live on the device (and in pinned host memory only while offloaded). vLLM is not built here: its
own copy of the weights (and, on a GPU at rollout.sleep_level=1, its host backup) come on top.
Each run is recorded in bench/results/host_memory.jsonl (every rank's stages).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "hybridrl" / "demo_model"
GIB = 2.0**30


def _status() -> dict[str, float]:
    """VmRSS and RssAnon of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = float(value.split()[0]) * 1024
    return out


class Sampler:
    """Peak VmRSS / RssAnon since the last `stage()` call, sampled by a thread."""

    def __init__(self, period_s: float = 0.005):
        self.period_s, self.peak, self.rows = period_s, {}, []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._reset()
        self._thread.start()

    def _reset(self) -> None:
        with self._lock:
            self.peak = _status()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = _status()
            with self._lock:
                self.peak = {k: max(self.peak.get(k, 0.0), v) for k, v in now.items()}
            time.sleep(self.period_s)

    def stage(self, name: str) -> None:
        """Close the stage that just ran as `name`: its peak and what is held at its end."""
        now = _status()
        with self._lock:
            peak = {k: max(self.peak.get(k, 0.0), v) for k, v in now.items()}
        self.rows.append(
            {
                "stage": name,
                "rss": now["VmRSS"],
                "private": now["RssAnon"],
                "peak_rss": peak["VmRSS"],
                "peak_private": peak["RssAnon"],
            }
        )
        self._reset()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def rank_main(local_rank: int, args, port: int, model: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from hybridrl.core import environ

    environ.setup()
    sampler = Sampler()
    import torch

    from hybridrl.core import config, launch
    from hybridrl.data.batch import Batch
    from hybridrl.engines.reference import Reference
    from hybridrl.engines.trainer import Trainer

    world = launch.init_distributed()
    sampler.stage("imports, process group")
    overrides = {
        "train.zero_stage": args.zero,
        "algo.kl_coef": 0.05 if args.reference else 0.0,
        "model.dtype": args.dtype,
        "train.max_tokens_per_micro_batch": 256,
    }
    if args.critic:
        overrides["algo.advantage"] = "gae"
    cfg = config.load(None, overrides)
    kw = dict(device=world.device, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    trainer = Trainer(cfg, model, **kw)
    sampler.stage(f"trainer (ZeRO-{args.zero})")
    ref = Reference.load(cfg, model, **kw)
    sampler.stage("reference" if ref else "reference (off)")
    critic = None
    if args.critic:
        from hybridrl.engines.critic import Critic

        critic = Critic(cfg, model, **kw)
        sampler.stage("critic")
    if not args.step:
        rows_of(world, sampler, out_dir)
        return
    g, vocab = torch.Generator().manual_seed(world.rank), min(100, trainer.hf.config.vocab_size)
    batch = Batch.from_rows(
        [torch.randint(3, vocab, (12,), generator=g).tolist() for _ in range(4)],
        [torch.randint(3, vocab, (4,), generator=g).tolist() for _ in range(4)],
        [[-1.0] * 4] * 4,
        [1.0, -1.0, 0.5, -0.5],
    )
    if ref:
        batch.logp_ref = ref.logprobs(batch, 1.0)
    trainer.step(batch)
    if critic:
        batch.values = critic.values(batch)
        batch.returns = batch.values + 1.0
        critic.step(batch)
    sampler.stage("one step (ref log-probs, train)")
    rows_of(world, sampler, out_dir)


def rows_of(world, sampler: Sampler, out_dir: str) -> None:
    """Every rank's stages, written by rank 0."""
    import torch

    sampler.close()
    rows = [None] * world.size
    torch.distributed.all_gather_object(rows, sampler.rows)
    if world.main:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))
    torch.distributed.barrier()


def table(rows: list[list[dict]], model_bytes: float) -> str:
    lines = [
        "| stage | " + " | ".join(f"rank {r}: peak RSS / private / held at end" for r in range(len(rows))) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for i, stage in enumerate(rows[0]):
        cells = [
            f"{r[i]['peak_rss'] / GIB:.2f} / {r[i]['peak_private'] / GIB:.2f} / {r[i]['rss'] / GIB:.2f} GiB"
            for r in rows
        ]
        lines.append(f"| {stage['stage']} | " + " | ".join(cells) + " |")
    peak = max(s["peak_rss"] for r in rows for s in r)
    private = max(s["peak_private"] for r in rows for s in r)
    lines.append(
        f"\nlargest peak on any rank: RSS {peak / GIB:.2f} GiB, private {private / GIB:.2f} GiB "
        f"(one copy of the model's weights: {model_bytes / GIB:.2f} GiB)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen0.5b", help="qwen0.5b (built once, random weights), demo, or a directory")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-reference", dest="reference", action="store_false", help="algo.kl_coef=0")
    ap.add_argument("--critic", action="store_true", help="also build PPO's critic (algo.advantage=gae)")
    ap.add_argument(
        "--no-step",
        dest="step",
        action="store_false",
        help="only build the engines (the step's "
        "optimizer states are the same either way; this keeps a float32 run within a small machine)",
    )
    ap.add_argument("--tag", default="", help="a label kept with the recorded row (e.g. before/after a change)")
    args = ap.parse_args()
    import tempfile

    from hybridrl.core import environ

    environ.setup()
    model = args.model
    if model == "qwen0.5b":
        from bench.memory import qwen2_half_b

        model = str(qwen2_half_b(environ.cache_dir() / "bench-qwen2-0.5b"))
    elif model == "demo":
        model = str(DEMO)
    import torch.multiprocessing as mp

    from hybridrl.core.launch import _free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            rank_main, args=(args, _free_port(), model, out_dir), nprocs=args.ranks, start_method="spawn"
        )
        rows = json.loads(Path(out_dir, "rows.json").read_text())
    from safetensors import safe_open

    model_bytes = 0.0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                model_bytes += n * (2 if args.dtype == "bfloat16" else 4)
    device = "cuda" if environ.has_cuda() else "cpu"
    print(
        f"\n{device}, model {Path(model).name}, {args.ranks} ranks, ZeRO-{args.zero}, {args.dtype}, "
        f"reference {'on' if args.reference else 'off'}, critic {'on' if args.critic else 'off'}"
        f"{'' if args.step else ', no step'}\n"
    )
    print(table(rows, model_bytes))
    record(
        "host_memory",
        {**vars(args), "model_name": Path(model).name},
        {
            "rows": rows,
            "model_gib": model_bytes / GIB,
            "peak_rss_gib": max(s["peak_rss"] for r in rows for s in r) / GIB,
            "peak_private_gib": max(s["peak_private"] for r in rows for s in r) / GIB,
        },
    )


if __name__ == "__main__":
    main()
