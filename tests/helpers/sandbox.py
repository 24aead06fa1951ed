"""What the sandbox's tests share: the processes a sandboxed program could have left running."""

import os
from pathlib import Path


def left_over() -> list[int]:
    """Sandboxed programs still running anywhere on this machine: processes in a PID namespace nested
    two deep below this one's (a jail's, then a program's own)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                status = Path(f"/proc/{d}/status").read_text()
            except OSError:
                continue
            depth = next((len(line.split()) - 1 for line in status.splitlines() if line.startswith("NSpid:")), 1)
            if depth >= 3:
                found.append(int(d))
    return found
