"""The ground floor: what every other floor imports, importing nothing of hybridrl's above it. The
config tree and its recipes (schema.py, config.py, recipe.py), what the model is (models.py), the
process environment and launch (environ.py, launch.py), the platform switch (platform.py), the
run's journal, logs and canaries (journal.py, logs.py, canaries.py), memory probes and policy
(memory.py), and the watchdog (faults.py). tests/test_imports.py holds the floors."""
