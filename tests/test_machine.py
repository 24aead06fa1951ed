"""The suite's own rule for CUDA machines (machine.py, applied by conftest.py): a test that
assumes the CPU stack, or more ranks than there are GPUs, is skipped there with its reason."""

import pytest

from machine import skip_reason

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)


def test_cpu_machines_run_everything():
    for cpu_only in (None, "fp32 probe"):
        for devices in (1, 2, 8):
            assert skip_reason(cuda=False, n_gpus=0, cpu_only=cpu_only, devices=devices) is None


def test_cuda_machines_skip_cpu_assumptions_with_the_reason():
    assert (
        skip_reason(cuda=True, n_gpus=8, cpu_only="asserts the CPU sleep-mode note", devices=1)
        == "CUDA machine: asserts the CPU sleep-mode note"
    )
    assert (
        skip_reason(cuda=True, n_gpus=1, cpu_only=None, devices=2)
        == "needs 2 GPUs (one per rank, --nproc 2); this machine has 1"
    )
    assert skip_reason(cuda=True, n_gpus=2, cpu_only=None, devices=2) is None  # runs
    assert skip_reason(cuda=True, n_gpus=1, cpu_only=None, devices=1) is None


def test_markers_reach_the_hook(pytester):
    """The hook reads `cpu_only`'s reason and `devices`, or a parametrized `nproc`, from the items."""
    pytester.makeconftest(
        "import machine\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    machine.skip_on(items, True, 1)  # a machine with one GPU\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    cpu_only(reason): x\n    devices(n): x\n")
    pytester.makepyfile(
        test_marked="""
import pytest

@pytest.mark.cpu_only("bitwise on CPU")
def test_a(): pass

@pytest.mark.devices(2)
def test_b(): pass

@pytest.mark.parametrize("nproc", [1, 2])
def test_c(nproc): pass

def test_d(): pass
"""
    )
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, skipped=3)  # test_c[1] and test_d run on the 1-GPU machine
    result.stdout.fnmatch_lines(["*CUDA machine: bitwise on CPU*", "*needs 2 GPUs (one per rank, --nproc 2)*"])
