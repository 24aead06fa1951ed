"""What a run shows: the live progress line and the run's sinks (progress.py) and `hybridrl report`
(report.py). The ground utilities they use (logs, canaries, the watchdog) are in core/."""
