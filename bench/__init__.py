"""hybridrl's benchmarks, one module each, run from the repository root as modules:

    python -m bench.peers --workload demo      # hybridrl vs TRL's GRPOTrainer
    python -m bench.gpu_check --list           # the GPU self-check's claims

Every module has a --help. Bench-internal imports are `from bench.x import ...`; a bench that
runs another bench in a subprocess does it as `python -m bench.x` with the repository root as the
working directory, so no module edits sys.path. Results: bench/results.py (one JSON line per run
in bench/results/<bench>.jsonl); tables in README.md and docs/ from them: bench/render.py.
"""
