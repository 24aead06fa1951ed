"""What goes in and what is scored: prompts (prompts.py), the sample and batch types (batch.py),
rewards and verifiers, the environment protocol (envs.py), partial rollouts' buffer (partial.py).
Driving the engine to collect a batch is the run's (run/collect.py, run/multiturn.py)."""
