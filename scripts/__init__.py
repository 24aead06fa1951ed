"""Process tools, run from the repository root: the Python ones as modules (`python -m scripts.lease
--plan`, the next GPU lease), the shell ones as files (scripts/check_subjects.sh, gpu_bundle.sh).
They drive runs and machines and measure nothing themselves; the benchmarks are bench/."""
