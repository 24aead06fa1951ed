"""Failure isolation: a watchdog that stops a run whose step makes no progress, and names the rank
that stalled; plus the test-only fault injections the fault suite (tests/test_faults.py) uses.

Every phase of the loop reports itself with `progress(step, phase)`. The watchdog (a daemon
thread, one per rank, on while `train.watchdog_s > 0`) fires when its rank has reported nothing
for `train.watchdog_s` seconds (a checkpoint's save for longer: `save_limit_s`). Each rank also
posts its progress count to the process group's key-value store (the one torchrun hosts), so a
firing watchdog can tell a rank that stalled (the one furthest behind: stuck in a Python loop, a
deadlocked verifier, a dead filesystem) from the ranks that merely wait for it in a collective. It
then prints which rank stalled where, dumps every thread's stack (faulthandler) to stderr and
`<run_dir>/watchdog-rank<R>.txt`, and exits with code WATCHDOG_EXIT; the launcher stops the other
ranks. A rank that *dies* is caught sooner by torchrun's agent (launch._failure_message names it).

A stall that holds the GIL (stuck inside a C extension) starves the watchdog thread; for that
faulthandler's own C-level timer, re-armed by the progress reports, dumps the stacks and exits
at least 60 s after the watchdog would have. The process group's collective timeout is
2 x `train.watchdog_s` (launch.init_distributed; a save's: 2 x its limit), a last resort if neither
could act.

Departs from torch's NCCL/gloo watchdogs: those only see collectives, so a rank stuck before its
collective shows up on the *other* ranks as an anonymous timeout after 10-30 minutes.
"""

from __future__ import annotations

import errno
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

WATCHDOG_EXIT = 75  # launch._failure_message recognises it
_KEY = "hybridrl/observe/progress/{}"
_current: "Watchdog | None" = None


last = (0, "start")  # (step, phase) the loop reached last: what an engine failure names


def progress(step: int, phase: str, where: Path | None = None, limit_s: float | None = None) -> None:
    """The loop reached `phase` of `step`: feeds the watchdog (if one runs) and test injections
    (`where`: the directory a 'fill' or 'enospc' fault concerns). `limit_s`: this phase may run that
    long before the watchdog fires (a checkpoint's save: `save_limit_s`), instead of train.watchdog_s."""
    global last
    last = (step, phase)
    if _current is not None:
        _current.beat(step, phase, limit_s)
    if _FAULT:
        _inject(step, phase, where)


def save_limit_s(watchdog_s: float, nbytes: int, write_mb_s: float) -> float:
    """The watchdog's limit for a save of `nbytes`: train.watchdog_s plus the time to write them at
    ckpt.write_mb_s, the slowest the storage is expected to go. A 72B run's checkpoint (~1 TB:
    bf16 weights and 12 bytes of optimizer state a parameter) outlasts any fixed limit on network
    storage, and a rank's shard is one torch.save plus an fsync, with nothing in between to report
    progress. 0 while the watchdog is off."""
    if watchdog_s <= 0:
        return 0.0
    return watchdog_s + nbytes / (write_mb_s * 2**20)


class Watchdog:
    """`with Watchdog(seconds, rank, size, run_dir):` around the training loop (0 seconds = off)."""

    def __init__(self, seconds: float, rank: int, size: int, run_dir: str | Path):
        self.seconds, self.rank, self.size, self.run_dir = float(seconds), rank, size, Path(run_dir)
        self.n, self.step, self.phase, self.at = 0, 0, "start", time.monotonic()
        self.limit = self.seconds  # the current phase's (progress's limit_s)
        self._armed_at = 0.0
        self._stop = threading.Event()
        self._store = None
        if size > 1 and dist.is_initialized():
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 -- without a store the watchdog still fires, unable to name others
                self._store = None

    def __enter__(self):
        global _current
        if self.seconds > 0:
            _current = self
            self.beat(self.step, self.phase)
            threading.Thread(target=self._watch, name="hybridrl-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc):
        global _current
        if _current is self:
            _current = None
            self._stop.set()
            faulthandler.cancel_dump_traceback_later()

    def beat(self, step: int, phase: str, limit_s: float | None = None) -> None:
        limit = max(self.seconds, limit_s or 0)
        self.n, self.step, self.phase, self.at = self.n + 1, step, phase, time.monotonic()
        if self._store is not None:
            self._store.set(_KEY.format(self.rank), f"{self.n} {step} {phase}")
        # re-arming starts a thread: not on every phase, but whenever the limit changes
        if self.at - self._armed_at > self.seconds / 10 or limit != self.limit:
            # armed at most seconds/10 before this report, so it fires >= 60 s after the watchdog would
            if (err := _real_stderr()) is not None:
                faulthandler.dump_traceback_later(limit * 1.1 + 60, exit=True, file=err)
            self._armed_at = self.at
        self.limit = limit

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            if self.overdue():
                self._fire()

    def overdue(self) -> bool:
        """The current phase has run past its limit with no report."""
        return time.monotonic() - self.at > self.limit

    def _others(self) -> dict[int, tuple[int, int, str]]:
        """Each rank's last report (count, step, phase), as far as the store can say."""
        out = {}
        for r in range(self.size):
            try:
                if self._store.check([_KEY.format(r)]):
                    n, step, phase = self._store.get(_KEY.format(r)).decode().split(" ", 2)
                    out[r] = (int(n), int(step), phase)
            except Exception:  # noqa: BLE001 -- the store's host may be gone too
                pass
        return out

    def verdict(self) -> str:
        """Which rank stalled, in words."""
        idle = time.monotonic() - self.at
        limit = (
            f"train.watchdog_s={self.seconds:g}"
            if self.limit == self.seconds
            else f"this phase's limit {self.limit:.0f} s: "
            f"train.watchdog_s={self.seconds:g} + its bytes at ckpt.write_mb_s"
        )
        mine = (
            f"rank {self.rank} has made no progress for {idle:.0f} s ({limit}), in phase '{self.phase}' of "
            f"step {self.step}"
        )
        if self.size == 1:
            return mine + "."
        seen = self._others() if self._store is not None else {}
        if len(seen) < self.size:
            return mine + f"; ranks {sorted(set(range(self.size)) - set(seen))} never reported (dead?)."
        behind = min(n for n, _, _ in seen.values())
        stuck = sorted(r for r, (n, _, _) in seen.items() if n == behind)
        if len(stuck) == self.size:  # progress is counted per phase: a stall inside one looks like this too
            return (
                mine + "; every rank stopped in the same phase (one rank stalled inside it, or a collective, "
                "the filesystem or the device is stuck: the stacks below show which waits where)."
            )
        where = ", ".join(f"rank {r} stalled in phase '{seen[r][2]}' of step {seen[r][1]}" for r in stuck)
        who = "this rank is the one furthest behind" if self.rank in stuck else "the others wait for it in a collective"
        return f"{mine}. Cause: {where} ({who})."

    def _fire(self) -> None:
        text = f"hybridrl watchdog: {self.verdict()} Stopping this rank."
        dump = self.run_dir / f"watchdog-rank{self.rank}.txt"
        try:
            with open(dump, "w") as f:
                f.write(text + "\n\n")
                faulthandler.dump_traceback(file=f, all_threads=True)
            text += f" Stacks: {dump}."
        except OSError:
            pass
        text += " Continue from the last checkpoint with: hybridrl train --resume auto (same --log.run_dir)."
        print(text, file=sys.stderr, flush=True)
        if (err := _real_stderr()) is not None:
            faulthandler.dump_traceback(file=err, all_threads=True)
        os._exit(WATCHDOG_EXIT)


def _real_stderr():
    """The process's own stderr for faulthandler, which needs a file descriptor; in a Jupyter
    kernel sys.stderr is a stream without one (the kernel keeps the original as sys.__stderr__)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
            continue
    return None


# --- test-only fault injection --------------------------------------------------------------------
# HYBRIDRL_TEST_FAULT="<action>@<step>:<phase>[:rank<R>]", e.g. "kill@3:train", "hang@2:generate:rank1".
#   kill   SIGKILL this process on entering the phase (a crash mid-step: nothing more is written)
#   term   SIGTERM this process (as a scheduler's preemption does)
#   hang   sleep forever in a Python loop (a stalled rank: only the watchdog can stop it)
#   fill   fill the checkpoint filesystem (phase 'save': after the DeepSpeed shards, before the rest),
#          so the next write fails with a real ENOSPC; the file stays, as another job's data would
#   enospc raise OSError(ENOSPC) at that point instead (for filesystems a test cannot fill safely)
_FAULT = os.environ.get("HYBRIDRL_TEST_FAULT", "")
FILL_NAME = "test-disk-filler"
# and faults in the data, counted by the code they concern (read here, the one place that reads
# test variables):
#   HYBRIDRL_TEST_CORRUPT_HAND_OFF=<n>  the n-th hand-off sends its first tensor shifted by 1 (hand_off below)
#   HYBRIDRL_TEST_NAN_AT_STEP=<n>       optimizer step n gets a NaN loss (Trainer.step)
_INJECT_AT = {
    kind: int(os.environ[var])
    for kind, var in (("corrupt_hand_off", "HYBRIDRL_TEST_CORRUPT_HAND_OFF"), ("nan_loss", "HYBRIDRL_TEST_NAN_AT_STEP"))
    if os.environ.get(var)
}


def injected(kind: str, count: int) -> bool:
    """Whether the test-only fault `kind` ('corrupt_hand_off', 'nan_loss') fires at this count."""
    return _INJECT_AT.get(kind) == count


_hand_offs = 0  # this process's hand-offs, counted for HYBRIDRL_TEST_CORRUPT_HAND_OFF


def hand_off(named):
    """The seam sync.push_weights sends its (name, tensor) stream through: the stream itself, except
    on the hand-off HYBRIDRL_TEST_CORRUPT_HAND_OFF names, where one tensor arrives shifted by 1, what
    the probe must catch. Here rather than in sync.py, so the hand-off carries no test state."""
    global _hand_offs
    _hand_offs += 1
    return _garbled(named) if injected("corrupt_hand_off", _hand_offs) else named


def _garbled(named):
    """The first tensor shifted by 1, or with LoRA the first B (A alone would change nothing while B
    is still ~0)."""
    done = False
    for name, t in named:
        hit = not done and (".lora_A." not in name)
        done |= hit
        yield name, (t + 1.0 if hit else t)


def _inject(step: int, phase: str, where: Path | None = None) -> None:
    action, _, spec = _FAULT.partition("@")
    at_step, at_phase, *rank = spec.split(":")
    if int(at_step) != step or at_phase != phase:
        return
    if rank and int(rank[0].removeprefix("rank")) != int(os.environ.get("RANK", "0")):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "hang":
        while True:
            time.sleep(0.5)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
    elif action == "fill" and where is not None:
        with open(where / FILL_NAME, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
