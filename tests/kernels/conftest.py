"""Kernel tests run Triton under its CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before anything imports triton, hence here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
