"""The run, the top floor: the loop (loop.py, start reading there), resolving a run's config
(resolve.py), collecting one batch (collect.py, multiturn.py), the command line (cli.py) with its
checks (preflight.py, doctor.py), checkpoints and stopping on a signal (checkpoint.py, signals.py),
export and evaluation."""
