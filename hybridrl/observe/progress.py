"""What a run shows and keeps, all on rank 0: a live progress line, `metrics.jsonl` in the run
dir (always), and TensorBoard / Weights & Biases when `log.tensorboard` / `log.wandb` are on.

Every record goes to every sink: a step's metrics, held-out accuracy, and the canaries'
warnings (see canaries.py). `hybridrl report RUN_DIR` reads metrics.jsonl back into plots.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from hybridrl.core import faults
from hybridrl.core.canaries import Canaries
from hybridrl.core.config import Config, ConfigError, to_dict
from hybridrl.core.journal import Journal, keep_upto
from hybridrl.core.launch import from_main
from hybridrl.core.memory import host_memory, peak_since_reset, reset_peak

# every phase a step times, in the order the loop runs them (engine_cycle.py: sleep ... wake_kv);
# `hybridrl report` stacks them in this order
PHASES = (
    "generate",
    "sleep",
    "reload",
    "reward",
    "reward_model",
    "old_logprob",
    "ref_logprob",
    "values",
    "train",
    "critic",
    "offload",
    "wake_weights",
    "sync",
    "wake_kv",
    "probe",
)


class Phases(dict):
    """Wall seconds per named phase: `with phases("train"): ...`.

    On CUDA it also records memory as each phase ends, in `.memory` as `mem/<phase>/<what>_gb`:
    allocated and reserved by PyTorch's allocator, the allocator's peak during the phase, and
    what the whole device has in use (which also counts vLLM's own pool, NCCL and other
    processes): the numbers that show which role holds memory when. The loop times every part
    of a step as a phase (PHASES), so the step metrics carry the memory after each. On every
    device it records this process's host memory: `host/rss_gb` (the most resident at the end of
    any phase of the step), `host/peak_gb` (the process's peak so far) and `host/<phase>/peak_gb`
    (the peak during that phase: the kernel's high-water mark is reset as each phase begins)."""

    def __init__(self, step: int | None = None):
        super().__init__()
        self.step = step  # given: each phase's start is reported to faults.progress (the watchdog)
        self.memory: dict[str, float] = {}
        # not initialised = nothing allocated yet, and querying would create a CUDA context
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    @contextmanager
    def __call__(self, name: str):
        if self.step is not None:
            faults.progress(self.step, name)
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        reset_peak()
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t
            rss, peak = host_memory()
            self.memory[f"host/{name}/peak_gb"] = max(
                self.memory.get(f"host/{name}/peak_gb", 0.0), peak_since_reset() * 2.0**-30
            )
            self.memory["host/rss_gb"] = max(self.memory.get("host/rss_gb", 0.0), rss * 2.0**-30)
            self.memory["host/peak_gb"] = max(self.memory["host/rss_gb"], peak * 2.0**-30)
            if self._cuda:
                free, total = torch.cuda.mem_get_info()
                gb = 2.0**-30
                self.memory.update(
                    {
                        f"mem/{name}/allocated_gb": torch.cuda.memory_allocated() * gb,
                        f"mem/{name}/reserved_gb": torch.cuda.memory_reserved() * gb,
                        f"mem/{name}/peak_gb": torch.cuda.max_memory_allocated() * gb,
                        f"mem/{name}/device_used_gb": (total - free) * gb,
                    }
                )


def _run_dir(cfg: Config, main: bool) -> Path:
    name = cfg.log.run_dir.format(time=time.strftime("%Y%m%d-%H%M%S")) if main else None
    return Path(from_main(name))  # one directory for all ranks


# --- sinks: each takes scalars and warning text, keyed by step ---------------------------------
class JsonlSink:
    """One JSON object per line; `hybridrl report` and the tests read this file. Appended to, never
    truncated: a resumed run's earlier rows were trimmed to its checkpoint (RunLog), and a crash at
    any point keeps every row written before it. A full disk drops rows (counted), not the run."""

    def __init__(self, path: Path):
        self.file = Journal(path)

    def write(self, record: dict) -> None:
        self.file.write(record)  # one unbuffered write: a crashed run keeps every step it finished

    def scalars(self, step: int, values: dict) -> None:
        self.write({"step": step, **values})

    def warning(self, step: int, text: str) -> None:
        self.write({"step": step, "warning": text})

    def close(self, summary: dict) -> None:
        self.write({"summary": summary})
        self.file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "log.tensorboard needs the tensorboard package: "
                "pip install 'hybridrl[log]' (or set log.tensorboard false)"
            ) from None
        # purge_step: a resumed run hides the events its crashed predecessor logged after the checkpoint
        self.w = SummaryWriter(log_dir=str(log_dir), flush_secs=10, purge_step=purge_step)

    def scalars(self, step: int, values: dict) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self.w.add_scalar(k, v, step)

    def warning(self, step: int, text: str) -> None:
        self.w.add_text("warnings", text, step)

    def samples(self, step: int, rows: list[dict]) -> None:
        self.w.add_text(
            "samples",
            "\n\n".join(
                f"**prompt** {r['prompt']}\n\n**completion** {r['completion']}\n\n**reward** {r['reward']:g}"
                for r in rows
            ),
            step,
        )

    def close(self, summary: dict) -> None:
        self.w.add_text("summary", "\n\n".join(f"{k}: {v}" for k, v in summary.items()))
        self.w.close()


def wandb_mode(setting: str) -> str:
    """auto: $WANDB_MODE if set, else online when an API key is configured ($WANDB_API_KEY or
    `wandb login`'s netrc entry), else offline, so a run never stops at a login prompt."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return "online" if netrc.netrc(os.environ.get("NETRC")).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandbSink:
    def __init__(self, cfg: Config, run_dir: Path):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "log.wandb needs the wandb package: pip install 'hybridrl[log]' (or set log.wandb false)"
            ) from None
        mode = wandb_mode(cfg.log.wandb_mode)
        # console="off": wandb must not wrap stdout, which would break the live progress line
        self.run = wandb.init(
            project=cfg.log.wandb_project,
            dir=str(run_dir),
            name=run_dir.name,
            config=to_dict(cfg),
            mode=mode,
            settings=wandb.Settings(console="off", silent=True),
        )
        if mode == "offline":
            print(
                f"wandb: offline run in {self.run.dir}; upload it with `wandb sync {Path(self.run.dir).parent}`",
                flush=True,
            )

    def scalars(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def warning(self, step: int, text: str) -> None:
        self.run.log({"warning": text}, step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        import wandb

        table = wandb.Table(
            columns=["step", "prompt", "completion", "answer", "reward"],
            data=[[step, r["prompt"], r["completion"], r["answer"], r["reward"]] for r in rows],
        )
        self.run.log({"samples": table}, step=step)

    def close(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()


APPENDED = ("metrics.jsonl", "samples.jsonl", "reward_dead_letter.jsonl", "env_dead_letter.jsonl")


class RunLog:
    def __init__(self, cfg: Config, world, recipe: list[str] | None = None, resume_step: int | None = None):
        """recipe: the lines recipe.describe wrote, printed now and kept atop config.yaml.
        resume_step: a resumed run's checkpoint step; the run dir's appended files keep their rows
        up to it (the steps after it are about to be replayed) and the new rows are appended."""
        self.main = world.main
        self.dir = _run_dir(cfg, self.main)
        self.tty = sys.stdout.isatty()
        self.progress = cfg.log.progress
        self.total = cfg.train.steps
        self.last_acc: float | None = None
        self.first_acc: float | None = None
        self.eval_n = cfg.log.eval_n
        self.first_sampled: dict = {}  # eval/mean@n at step 0 (none in a resumed process) and the latest
        self.last_sampled: dict = {}
        self._last_print = 0.0
        self._live = ""  # the step line a TTY shows at the bottom
        self.canaries = Canaries()
        self.warnings: list[str] = []
        self.sinks: list = []
        self.counts: dict[str, float] = {}  # data/* row counts, for the summary
        self._unlogged: dict[str, float] = {}  # ... and for the first step's record
        if self.main:
            self.dir.mkdir(parents=True, exist_ok=True)
            header = "".join(f"# {line}\n" for line in recipe or [])
            (self.dir / "config.yaml").write_text(header + yaml.safe_dump(to_dict(cfg), sort_keys=False))
            if recipe:
                print("\n".join(recipe), flush=True)
            if resume_step is not None:
                for name in APPENDED:
                    keep_upto(self.dir / name, resume_step)
            else:  # a fresh run in a used run dir starts its metrics afresh, as it always did
                (self.dir / "metrics.jsonl").write_text("")
            self.sinks.append(JsonlSink(self.dir / "metrics.jsonl"))
            self._samples = Journal(self.dir / "samples.jsonl")
            if cfg.log.tensorboard:
                self.sinks.append(
                    TensorBoardSink(self.dir / "tensorboard", None if resume_step is None else resume_step + 1)
                )
            if cfg.log.wandb:
                self.sinks.append(WandbSink(cfg, self.dir))

    def resume(self, acc_before: float | None, last_acc: float | None) -> None:
        """Continue a resumed run's log with its accuracies so far (its rows are in metrics.jsonl)."""
        self.first_acc, self.last_acc = acc_before, last_acc

    def data(self, counts: dict[str, float]) -> None:
        """Rows kept and dropped (data/*), and figures of the run's start (the probe's calibrated
        bound): logged with the first step's metrics and in the summary."""
        self.counts.update(counts)
        self._unlogged.update(counts)

    def samples(self, step: int, rows: list[dict]) -> None:
        """A few held-out prompts, completions and rewards: samples.jsonl and the sinks that show text."""
        if not self.main or not rows:
            return
        self._samples.write(*({"step": step, **r} for r in rows))
        for s in self.sinks:
            if hasattr(s, "samples"):
                s.samples(step, rows)

    def eval(self, step: int, acc: float, sampled: dict | None = None, seconds: float | None = None) -> None:
        """acc: greedy held-out accuracy (logged as heldout_acc and eval/pass@1); sampled:
        eval/mean@n and eval/n_samples when log.eval_n > 0; seconds: how long it took (time/eval,
        which the run's elapsed_s includes: bench/real.py takes it out of a training clock)."""
        self.first_acc = acc if self.first_acc is None else self.first_acc
        self.last_acc = acc
        self.last_sampled = dict(sampled or {})
        if step == 0:
            self.first_sampled = self.last_sampled
        for s in self.sinks:
            s.scalars(
                step,
                {
                    "heldout_acc": acc,
                    "eval/pass@1": acc,
                    **self.last_sampled,
                    **({"time/eval": seconds} if seconds is not None else {}),
                },
            )
        mean = f"  mean@{self.eval_n} {sampled['eval/mean@n']:6.1%}" if "eval/mean@n" in self.last_sampled else ""
        self._line(f"step {step:>4}/{self.total}  held-out accuracy {acc:6.1%}{mean}", force=True)

    def step(self, step: int, m: dict) -> None:
        if not self.main:
            return
        if self._unlogged:
            m, self._unlogged = {**m, **self._unlogged}, {}
        for s in self.sinks:
            s.scalars(step, m)
        acc = "  --  " if self.last_acc is None else f"{self.last_acc:6.1%}"
        t = sum(v for k, v in m.items() if k.startswith("time/"))
        if self.progress:
            kl = f"teacher KL {m['teacher_kl']:.3f}  " if "teacher_kl" in m else ""  # distillation's signal
            self._line(
                f"step {step:>4}/{self.total}  reward {m['reward']:.3f}  {kl}held-out {acc}  "
                f"{m['rollout_tok_s']:7.0f} rollout tok/s  {t * 1000:6.0f} ms/step  "
                f"[{m['elapsed_s']:5.0f}s]"
            )
        for text in self.canaries.check(step, m):
            self.warnings.append(text)
            for s in self.sinks:
                s.warning(step, text)
            self._line(f"warning: {text}", force=True)

    def _line(self, text: str, force: bool = False) -> None:
        if not self.main:
            return
        if self.tty:  # one live line, rewritten in place; evals and warnings scroll up above it
            if not force:
                self._live = text
            print("\r\033[K" + (text + "\n" + self._live if force else text), end="", flush=True)
        elif force or time.perf_counter() - self._last_print > 5:
            print(text, flush=True)
            self._last_print = time.perf_counter()

    def close(self, summary: dict) -> None:
        if not self.main:
            return
        summary = {
            **summary,
            **self.counts,
            "warnings": len(self.warnings),
            "truncation_warnings": self.canaries.fired.get("truncated", 0),
        }
        dropped = self._samples.dropped + sum(s.file.dropped for s in self.sinks if isinstance(s, JsonlSink))
        if dropped:  # a full disk: the summary row itself may not get written, so say it here too
            summary["log_rows_dropped"] = dropped
            print(
                f"warning: {dropped} row(s) of metrics.jsonl / samples.jsonl could not be written (disk full?)",
                file=sys.stderr,
                flush=True,
            )
        self._samples.close()
        for s in self.sinks:
            s.close(summary)
        before, after = summary["heldout_acc_before"], summary["heldout_acc_after"]
        acc = "n/a (no held-out split: set data.heldout_path)" if before is None else f"{before:.1%} -> {after:.1%}"
        if "eval/mean@n" in self.last_sampled:
            first = self.first_sampled.get("eval/mean@n")
            acc += (
                f" (pass@1), mean@{self.eval_n} {'' if first is None else f'{first:.1%} -> '}"
                f"{self.last_sampled['eval/mean@n']:.1%}"
            )
        print(
            f"\nheld-out accuracy: {acc}  ({summary['steps']} steps, {summary['minutes']:.1f} min, "
            f"run dir {self.dir})" + (f"; {len(self.warnings)} warning(s), see metrics.jsonl" if self.warnings else ""),
            flush=True,
        )
