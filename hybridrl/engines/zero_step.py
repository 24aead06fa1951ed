"""One pass over the gradients where DeepSpeed's ZeRO-1/2 step makes two.

DeepSpeed's ZeRO-1/2 `step()` first checks every gradient for inf/NaN (a float32 copy of each,
summed) and then, if none is found, computes the gradient norm for clipping (a float32 copy of each
again, and torch's `vector_norm`): two reads of every gradient, a large share of the optimizer
step at real shapes on CPU (docs/speed.md). An inf or NaN anywhere makes the norm inf or NaN, so
the norm alone answers both: `install` gives the optimizer an overflow check that computes the
norm and keeps it for the clipping that follows. The norm is a sum of float32 dot products over
1M-element chunks, accumulated in float64: one read of every gradient, and nearer the exact norm
than `vector_norm`'s float32 sum, whose error grows with the number of elements.

Only where this was measured and tested: DeepSpeed's ZeRO-1/2 optimizer, on one rank, float32 or
bfloat16 (no loss scale), no CPU offload, no MoE layers. Anywhere else the optimizer is left as
DeepSpeed built it. What DeepSpeed does with an overflow (skip the update, weights and optimizer
states untouched) is unchanged; tests/test_zero_step.py checks both paths on a real engine.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 20  # elements per float32 dot product: a 4 MiB buffer, reused


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(sum of squares) of all gradients, in float64; inf or NaN if any entry is. Computed on
    the gradients' device (a GPU's gradients never cross to the host; one sync, by the caller)."""
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    buf = None
    for g in grads:
        flat = g.detach().reshape(-1)
        for c in flat.split(CHUNK):
            if c.dtype != torch.float32:
                if buf is None or buf.numel() < c.numel():
                    buf = torch.empty(max(c.numel(), min(CHUNK, flat.numel())), dtype=torch.float32, device=device)
                c = buf[:c.numel()].copy_(c)
            total += torch.dot(c, c).double()
    return total.sqrt()


def install(optimizer, world_size: int) -> bool:
    """Fuse the overflow check into the norm on `optimizer` (engine.optimizer) where it applies;
    True if it did."""
    applies = (type(optimizer).__name__ == "DeepSpeedZeroOptimizer" and world_size == 1
               and getattr(optimizer, "dtype", None) in (torch.float32, torch.bfloat16)
               and not getattr(optimizer, "cpu_offload", True) and not getattr(optimizer, "has_moe_layers", True)
               and getattr(optimizer, "partition_gradients", None) is not None
               and float(getattr(optimizer, "loss_scale", 1.0)) == 1.0
               and callable(getattr(optimizer, "check_overflow", None))
               and callable(getattr(optimizer, "scaled_global_norm", None))
               and hasattr(optimizer, "averaged_gradients"))
    if not applies:
        return False
    kept: list[torch.Tensor] = []

    def norm() -> torch.Tensor:
        grads = [g for i in sorted(optimizer.averaged_gradients) for g in (optimizer.averaged_gradients[i] or [])
                 if g is not None]
        return grad_norm(grads).float()

    def check_overflow(partition_gradients=True):
        kept[:] = [norm()]
        optimizer.overflow = not bool(torch.isfinite(kept[0]))

    def scaled_global_norm(norm_type=2):
        assert norm_type == 2, "only the L2 norm"
        return kept.pop() if kept else norm()

    optimizer.check_overflow = check_overflow
    optimizer.scaled_global_norm = scaled_global_norm
    return True
