"""The run's append-only JSON-lines files (metrics.jsonl, samples.jsonl, the dead letters): what
they keep when the disk fills, when they grow without bound, and when a run resumes.

- A full disk (or any OSError) while appending does not stop the run: the row is counted as
  dropped, a warning is printed once per file, and the next row is tried again (space may come
  back). The checkpoint path has its own handling (checkpoint.Saver).
- `cap_bytes`: past that size the file takes no more rows (they are counted only), so a reward
  function that fails on every sample cannot fill the disk with dead letters.
- `keep_upto(path, step)`: on resume, the rows of steps after the checkpoint (the steps the run is
  about to replay) and earlier summaries go; the rest is never rewritten in place. When the rows
  kept are the head of the file (always, for files written here) it is truncated there, which
  needs no free space and is atomic; else a copy is written, fsync'd and renamed over it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("hybridrl")
# a dead-letter file's size past which its entries are counted only: thousands of failures with
# their prompts and completions, enough to debug; a reward that fails on every sample must not fill the disk
DEAD_LETTER_CAP = 64 << 20


class Journal:
    """`Journal(path).write(rows)`: each row one JSON line, appended with one write() (O_APPEND,
    so ranks appending to the same file do not interleave within a row)."""

    def __init__(self, path: str | Path, cap_bytes: int | None = None):
        self.path, self.cap = Path(path), cap_bytes
        self.fd: int | None = None
        self.dropped = 0  # rows not written: a write error, or past the cap
        self._torn = False  # a failed write may have left half a line: the next one starts afresh
        self._told: set[str] = set()

    def write(self, *rows: dict) -> bool:
        data = "".join(json.dumps(r, default=str) + "\n" for r in rows).encode()
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if self.cap is not None and os.fstat(self.fd).st_size >= self.cap:
                self._drop(
                    len(rows),
                    "cap",
                    f"{self.path} reached its cap of {self.cap / 2**20:.0f} MiB: further rows are counted, not written",
                )
                return False
            if self._torn:
                data = b"\n" + data
            if os.write(self.fd, data) != len(data):  # a short write: the disk filled mid-row
                raise OSError(28, "short write (no space left on device?)")
            self._torn = False
            return True
        except OSError as e:
            self._torn = True
            self._drop(
                len(rows),
                "error",
                f"cannot write {self.path} ({e}); its rows are counted, not written, "
                "and training goes on: free some space",
            )
            return False

    def _drop(self, n: int, kind: str, text: str) -> None:
        self.dropped += n
        if kind not in self._told:
            self._told.add(kind)
            log.warning(text)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def keep_upto(path: str | Path, step: int) -> int:
    """Drop the rows of steps after `step` and any summary row from JSON-lines file `path` (lines that
    do not parse go too: a row cut short by a crash). Returns the rows dropped. The rows kept are
    never rewritten in place (see the module docstring)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0
    lines = raw.splitlines(keepends=True)
    keep = [_kept(line, step) for line in lines]
    if all(keep):
        return 0
    head = keep.index(False)
    if not any(keep[head:]):  # the rows kept are the file's head: cut there
        with open(path, "r+b") as f:
            f.truncate(sum(len(x) for x in lines[:head]))
            f.flush()
            os.fsync(f.fileno())
    else:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(x for x, k in zip(lines, keep) if k))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    return keep.count(False)


def _kept(line: bytes, step: int) -> bool:
    try:
        r = json.loads(line)
    except ValueError:
        return False
    if not isinstance(r, dict) or "summary" in r:
        return False
    s = r.get("step")
    return not isinstance(s, int) or s <= step


def fsync_dir(path: str | Path) -> None:
    """A rename or a new file in `path` survives a power loss only once the directory is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
