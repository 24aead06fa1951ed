import os
import tempfile
from pathlib import Path

import pytest

# Caches go where the setup built them (the Makefile's .cache in the work tree), never ~/.cache and
# never a directory other users can write to (env.check_cache_dir).
os.environ.setdefault("HYBRIDRL_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# The suite needs no hub: an empty Hugging Face home, offline (hybridrl itself never moves HF_HOME,
# so a user's token and model cache stay where they are), and no test can reach the network.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hybridrl-test-hf-")
os.environ["HF_HUB_OFFLINE"] = "1"

from hybridrl.run import environ as env  # noqa: E402

env.setup()
pytest_plugins = ["pytester"]  # test_machine.py runs the hook on a pretend CUDA machine


def pytest_collection_modifyitems(config, items):
    """On a CUDA machine, tests that assume the CPU stack or more GPUs are skipped with the
    reason (machine.py)."""
    import machine
    cuda, n_gpus = machine.gpus()
    if cuda:
        machine.skip_on(items, cuda, n_gpus)


@pytest.fixture
def world_of_one():
    """torch.distributed in this process; its variables are gone afterwards (launch.forget_world),
    so a later test's subprocess (`hybridrl train --nproc 2`) is not taken for a launched rank."""
    from hybridrl.run import launch
    before = {k: os.environ.get(k) for k in launch.LAUNCHER_VARS}
    launch.init_distributed()
    yield
    launch.forget_world()
    assert {k: os.environ.get(k) for k in launch.LAUNCHER_VARS} == before
