"""What a run shows and keeps: a live progress line on rank 0 and `metrics.jsonl` in the run dir."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import yaml

from .config import Config, to_dict


class Phases(dict):
    """Wall seconds per named phase: `with phases("train"): ...`."""

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t


def _run_dir(cfg: Config, main: bool) -> Path:
    name = [cfg.log.run_dir.format(time=time.strftime("%Y%m%d-%H%M%S"))] if main else [None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)  # one directory for all ranks
    return Path(name[0])


class RunLog:
    def __init__(self, cfg: Config, world):
        self.main = world.main
        self.dir = _run_dir(cfg, self.main)
        self.tty = sys.stdout.isatty()
        self.total = cfg.train.steps
        self.last_acc: float | None = None
        self.first_acc: float | None = None
        self._last_print = 0.0
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            self.file = open(self.dir / "metrics.jsonl", "w")

    def _write(self, record: dict) -> None:
        if self.main:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def eval(self, step: int, acc: float) -> None:
        self.first_acc = acc if self.first_acc is None else self.first_acc
        self.last_acc = acc
        self._write({"step": step, "heldout_acc": acc})
        if self.main:
            self._line(f"step {step:>4}/{self.total}  held-out accuracy {acc:6.1%}", force=True)

    def step(self, step: int, m: dict) -> None:
        self._write({"step": step, **m})
        acc = "  --  " if self.last_acc is None else f"{self.last_acc:6.1%}"
        t = sum(v for k, v in m.items() if k.startswith("time/"))
        self._line(f"step {step:>4}/{self.total}  reward {m['reward']:.3f}  held-out {acc}  "
                   f"{m['rollout_tok_s']:7.0f} rollout tok/s  {t * 1000:6.0f} ms/step  "
                   f"[{m['elapsed_s']:5.0f}s]")

    def _line(self, text: str, force: bool = False) -> None:
        if not self.main:
            return
        if self.tty:  # one live line, rewritten in place; eval results stay on screen
            print("\r\033[K" + text, end="\n" if force else "", flush=True)
        elif force or time.perf_counter() - self._last_print > 5:
            print(text, flush=True)
            self._last_print = time.perf_counter()

    def close(self, summary: dict) -> None:
        self._write({"summary": summary})
        if self.main:
            self.file.close()
            before, after = summary["heldout_acc_before"], summary["heldout_acc_after"]
            acc = "n/a (no held-out split: set data.heldout_path)" if before is None else f"{before:.1%} -> {after:.1%}"
            print(f"\nheld-out accuracy: {acc}  ({summary['steps']} steps, {summary['minutes']:.1f} min, "
                  f"run dir {self.dir})", flush=True)
