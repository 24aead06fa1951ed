"""Stopping on a signal: SIGTERM/SIGINT ask the loop to finish its step, save a checkpoint
(checkpoint.py) and exit, every rank at the same step; a second SIGINT interrupts at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from hybridrl.core import launch


class StopSignals:
    """SIGTERM/SIGINT ask the loop to finish its step, save and exit (0 / 130). A second SIGINT
    interrupts at once. `requested()` is collective: every rank stops at the same step."""

    EXIT = {signal.SIGTERM: 0, signal.SIGINT: 130}

    def __init__(self, main: bool):
        self.main, self.signum, self._old, self._at = main, 0, {}, 0.0

    def __enter__(self):
        try:
            for s in self.EXIT:
                self._old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook's worker thread): no handlers
            pass
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            # under --nproc a Ctrl-C reaches a worker twice (the terminal, then the launcher
            # forwarding it): only a second press, a moment later, means "now"
            if time.monotonic() - self._at > 1.0:
                raise KeyboardInterrupt
            return
        self.signum, self._at = signum, time.monotonic()
        if self.main:
            print(
                f"\nreceived {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                "(SIGINT again to stop now)",
                flush=True,
            )

    def requested(self) -> int:
        return int(launch.all_max(self.signum))

    def summary(self, signum: int, step: int, ckpt: Path | None, run_dir: Path) -> dict:
        name = signal.Signals(signum).name
        if self.main:
            print(
                f"stopped by {name} after step {step}; checkpoint: {ckpt}\n"
                f"continue with: hybridrl train --resume {run_dir}",
                flush=True,
            )
        return {"stopped_by": name, "exit_code": self.EXIT[signal.Signals(signum)], "checkpoint": str(ckpt)}
