"""The run: the loop (loop.py, start reading there), its configuration (schema.py, config.py,
recipe.py), the command line and launch, checkpoints, export and evaluation."""
