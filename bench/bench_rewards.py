"""Rewards for benchmarks on random-initialised models, whose completions no verifier can score.

    --reward bench.bench_rewards:text_hash     (the repository root on PYTHONPATH; bench scripts set it)

A reward that varies between the samples of a group gives every group a non-zero advantage, so
every sample is trained on, as in a real run. Deterministic (crc32, not Python's salted hash).
"""

import zlib


def text_hash(prompt: str, completion: str, answer: str) -> float:
    """A number in [0, 1) fixed by the completion's text."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000.0


if __name__ == "__main__":  # python -m bench.bench_rewards --help: what this module is
    print(__doc__)
