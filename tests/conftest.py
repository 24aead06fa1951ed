import os
import tempfile

# Caches go where the setup built them (the Makefile sets this), never ~/.cache.
os.environ.setdefault("HYBRIDRL_CACHE_DIR", os.path.join(tempfile.gettempdir(), "hybridrl-cache"))

from hybridrl import env  # noqa: E402

env.setup()
pytest_plugins = ["pytester"]  # test_machine.py runs the hook on a pretend CUDA machine


def pytest_collection_modifyitems(config, items):
    """On a CUDA machine, tests that assume the CPU stack or more GPUs are skipped with the
    reason (machine.py)."""
    import machine
    cuda, n_gpus = machine.gpus()
    if cuda:
        machine.skip_on(items, cuda, n_gpus)
