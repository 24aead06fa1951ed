"""What goes in and what is scored: prompts (prompts.py), the batch type (batch.py), rewards and
verifiers, multi-turn environments (envs.py, multiturn.py), and collecting one batch (collect.py)."""
