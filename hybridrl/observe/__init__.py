"""What a run shows and checks: progress and logs, the report, canaries, `hybridrl doctor`, the
preflight checks before any engine starts, and the fault watchdog."""
