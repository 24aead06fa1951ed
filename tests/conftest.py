import os
import tempfile
from pathlib import Path

import pytest

# Caches go where the setup built them (the Makefile's .cache in the work tree), never ~/.cache and
# never a directory other users can write to (environ.check_cache_dir).
os.environ.setdefault("HYBRIDRL_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache"))
# The suite needs no hub: an empty Hugging Face home, offline (hybridrl itself never moves HF_HOME,
# so a user's token and model cache stay where they are), and no test can reach the network.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hybridrl-test-hf-")
os.environ["HF_HUB_OFFLINE"] = "1"

from hybridrl.core import environ  # noqa: E402

environ.setup()
pytest_plugins = ["pytester"]  # test_machine.py runs the hook on a pretend CUDA machine

import tiers  # noqa: E402  the fast tier (`-m fast`) and its guard


def pytest_configure(config):
    if tiers.is_fast_session(config):
        tiers.install()


def pytest_ignore_collect(collection_path, config):
    """In the fast tier, a test file that marks nothing fast is not even imported (tiers.py)."""
    if (
        tiers.is_fast_session(config)
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and not tiers.has_fast_tests(collection_path)
    ):
        return True
    return None


def _guarded():
    """A fast test (or its fixtures) that did what the tier forbids fails with that, also where the
    code under test caught the guard's exception."""
    try:
        result = yield
    except BaseException:
        if found := tiers.check():
            raise pytest.fail.Exception(found, pytrace=False) from None
        raise
    if found := tiers.check():
        pytest.fail(found, pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded())


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
    from hybridrl.core import launch

    before = {k: os.environ.get(k) for k in launch.LAUNCHER_VARS}
    launch.init_distributed()
    yield
    launch.forget_world()
    assert {k: os.environ.get(k) for k in launch.LAUNCHER_VARS} == before
