"""The only module that touches DeepSpeed's internals or checks DeepSpeed's version.

The CPU stack runs DeepSpeed 0.19.x on its CPU accelerator (constraints-cpu.txt); CUDA machines run
the release pinned in requirements-gpu.txt (0.19.8 today); pyproject.toml allows >= 0.17. The rest
of hybridrl uses DeepSpeed's public API only: `deepspeed.initialize`, `deepspeed.zero`'s Init (through
transformers), GatheredParameters and register_external_parameter, and the engine's own methods and
counters (backward, step, save_checkpoint, load_checkpoint, get_lr, global_steps, skipped_steps).
What reaches further is here: `deepspeed.runtime`'s enums, `deepspeed.accelerator`'s op builders,
`deepspeed.utils.zero_to_fp32`, the attributes of DeepSpeed's optimizers that the engine does not
publish, and the CPU branch of the config, so that a DeepSpeed upgrade changes one file. Where
releases differ, test for the feature (an attribute, a type's name), not the version number, and
keep both branches here. Which CPU-only path runs is platform.py's decision. The boundary is
held by tests/test_deepspeed_compat.py: no other module imports deepspeed.runtime, .ops, .utils
or .accelerator, or reads deepspeed.__version__.
"""

from __future__ import annotations

import torch


# --- the config ---------------------------------------------------------------------------------
def cpu_config(conf: dict, world_size: int) -> dict:
    """The CPU branch of a DeepSpeed config written for a GPU (zero_engine.ds_config), in place: what
    platform.Platform.cpu_ds_config turns on. Returns `conf`."""
    cpu_ops_without_debug_info()  # before the engine loads (or builds) its Adam op
    zero = conf["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):  # ZeRO-Offload's host copies: page-locked memory
        if key in zero:  # speeds a device's copies, and here there is no device
            zero[key]["pin_memory"] = False
    if zero["stage"] != 3 and world_size == 1:
        # contiguous gradients copy each gradient into one buffer as backward produces it, against
        # fragmentation of device memory; on one CPU rank that copy is all they do (a pass over
        # every gradient) and the step's own flattening does the same job (docs/speed.md)
        zero["contiguous_gradients"] = False
    return conf


# --- one pass over the gradients where DeepSpeed's ZeRO-1/2 step makes two -------------------------
# DeepSpeed's ZeRO-1/2 `step()` first checks every gradient for inf/NaN (a float32 copy of each,
# summed) and then, if none is found, computes the gradient norm for clipping (a float32 copy of each
# again, and torch's `vector_norm`): two reads of every gradient, a large share of the optimizer
# step at real shapes on CPU (docs/speed.md). An inf or NaN anywhere makes the norm inf or NaN, so
# the norm alone answers both: `fuse_overflow_check` gives the optimizer an overflow check that
# computes the norm and keeps it for the clipping that follows. The norm is a sum of float32 dot
# products over 1M-element chunks, accumulated in float64: one read of every gradient, and nearer
# the exact norm than `vector_norm`'s float32 sum, whose error grows with the number of elements.
#
# Only where this was measured and tested: DeepSpeed's ZeRO-1/2 optimizer, on one rank, float32 or
# bfloat16 (no loss scale), no CPU offload, no MoE layers. Anywhere else the optimizer is left as
# DeepSpeed built it. What DeepSpeed does with an overflow (skip the update, weights and optimizer
# states untouched) is unchanged; tests/test_zero_step.py checks both paths on a real engine.
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
                c = buf[: c.numel()].copy_(c)
            total += torch.dot(c, c).double()
    return total.sqrt()


def fuse_overflow_check(optimizer, world_size: int) -> bool:
    """Fuse the overflow check into the norm on `optimizer` (engine.optimizer) where it applies;
    True if it did."""
    applies = (
        type(optimizer).__name__ == "DeepSpeedZeroOptimizer"
        and world_size == 1
        and getattr(optimizer, "dtype", None) in (torch.float32, torch.bfloat16)
        and not getattr(optimizer, "cpu_offload", True)
        and not getattr(optimizer, "has_moe_layers", True)
        and getattr(optimizer, "partition_gradients", None) is not None
        and float(getattr(optimizer, "loss_scale", 1.0)) == 1.0
        and callable(getattr(optimizer, "check_overflow", None))
        and callable(getattr(optimizer, "scaled_global_norm", None))
        and hasattr(optimizer, "averaged_gradients")
    )
    if not applies:
        return False
    kept: list[torch.Tensor] = []

    def norm() -> torch.Tensor:
        grads = [
            g
            for i in sorted(optimizer.averaged_gradients)
            for g in (optimizer.averaged_gradients[i] or [])
            if g is not None
        ]
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


# --- the optimizer --------------------------------------------------------------------------------
def fresh_cpu_adam_powers(engine) -> None:
    """DeepSpeed's CPU FusedAdam keeps beta^t inside its C++ op (IncrementStep in
    csrc/includes/cpu_adam.h), outside any state_dict, in one object per process that every engine
    here shares (the policy and the critic). It advances it as a running product while the step
    grows by one and recomputes pow(beta, t) otherwise, so its bits depend on the order in which
    the engines stepped since the process started: a resumed process, or a critic interleaving two
    minibatch steps with the policy's, would not reproduce them. A step on a one-element dummy with
    other betas just before each real step makes the op take pow(beta, t) afresh: every update
    then depends on its step number alone, the same after a resume. (One scalar update; a no-op
    where the optimizer is not this op. Called where platform.Platform.fresh_adam_powers says.)"""
    opt = getattr(engine.optimizer, "optimizer", None)  # ZeRO's wrapper -> DeepSpeed's FusedAdam
    if not hasattr(opt, "multi_tensor_adam") or opt._dummy_overflow_buf.device.type != "cpu":
        return  # CUDA's FusedAdam has the same attribute, but its kernel takes beta^t from the step each call
    group = opt.param_groups[0]
    dummy = [[torch.zeros(1)] for _ in range(4)]  # grad, param, exp_avg, exp_avg_sq
    opt.multi_tensor_adam(
        1,
        opt._dummy_overflow_buf,
        dummy,
        group["lr"],
        -1.0,
        -1.0,
        group["eps"],
        1,
        opt.adam_w_mode,
        1,
        group["weight_decay"],
    )  # betas -1: never a real run's; 1: chunk, unused


def optimizer_states_exist(engine) -> bool:
    """Whether the engine's optimizer holds any state yet: DeepSpeed's Adam creates its moments at
    the first step (the optimizer inside ZeRO's wrapper, or the engine's own without one)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return any(inner.state.values())


# --- offloading the training states --------------------------------------------------------------
def offload_states(engine, include: list[str] | None = None) -> None:
    """DeepSpeed's offload_states to host memory (pinned on a GPU): `include` names OffloadStateTypeEnum
    members (optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer; None = all).
    Both ZeRO optimizers read `device.value`, so the device must be the enum, not "cpu". The
    policy and the critic both offload this way."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    states = None if include is None else [OffloadStateTypeEnum(s) for s in include]
    pinned = get_accelerator().device_name() == "cuda"  # the engine's device: pinned host pages copy faster
    engine.offload_states(include=states, device=OffloadDeviceEnum.cpu, pin_memory=pinned, non_blocking=False)


def reload_states(engine) -> None:
    """Back onto the device whatever offload_states moved off (nothing if nothing was)."""
    if engine.optimizer.offloaded_states:
        engine.reload_states(non_blocking=False)


def forget_stale_groups() -> None:
    """DeepSpeed caches its clone of the world process group (deepspeed.utils.groups) for the life of
    the process. When that group is destroyed outside DeepSpeed (an in-process vLLM engine's teardown,
    in a notebook or a test that built one), DeepSpeed's next engine fails on the stale clone ("Group
    ... is not registered"). Its references are dropped, as DeepSpeed's own teardown drops them, so
    the next engine clones the live world."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    cached = getattr(groups, "_WORLD_GROUP", None)
    if cached is None or not dist.is_initialized() or not hasattr(groups, "_release_process_group_references"):
        return
    try:
        dist.get_process_group_ranks(cached)
    except (ValueError, RuntimeError, KeyError):  # torch knows it no more
        groups._release_process_group_references()


# --- parameters and checkpoints ------------------------------------------------------------------
def moe_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Make every mixture-of-experts block a ZeRO-3 leaf module (DeepSpeed's `set_z3_leaf_modules`):
    its parameters, router and every expert, are gathered together when the block starts. Without
    it ZeRO-3 gathers a submodule's parameters as it runs, and each rank runs only the experts its
    tokens were routed to: ranks that route differently call different gathers and wait for each
    other forever (DeepSpeed's docs on Mixtral). A block is a module with a `gate` (the router)
    and an `experts` child (transformers' *SparseMoeBlock); returns the block classes' names."""
    from deepspeed.utils import set_z3_leaf_modules

    kinds = sorted(
        {
            type(m)
            for m in model.modules()
            if hasattr(m, "gate") and hasattr(m, "experts") and isinstance(getattr(m, "experts"), torch.nn.Module)
        },
        key=lambda k: k.__name__,
    )
    if kinds:
        set_z3_leaf_modules(model, kinds)
    return [k.__name__ for k in kinds]


def full_numel(p: torch.Tensor) -> int:
    """A parameter's element count, the whole tensor's even where ZeRO-3 has partitioned it (its
    `ds_numel`; the local tensor is then empty)."""
    return getattr(p, "ds_numel", p.numel())


def fp32_state_dict(path: str, tag: str) -> dict[str, torch.Tensor]:
    """The float32 weights of DeepSpeed checkpoint `tag` under `path`, consolidated from its ZeRO-2/3
    shards (DeepSpeed's zero_to_fp32), named as the engine's module names them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(path, tag=tag)


# --- JIT ops ------------------------------------------------------------------------------------------
def op_builder(name: str):
    """DeepSpeed's builder of JIT op `name` (e.g. "FusedAdamBuilder") for this machine's accelerator;
    None where the accelerator has none."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(name)


def cpu_ops_without_debug_info() -> None:
    """DeepSpeed's CPU ops (its Adam ops: CPUOpBuilder.cxx_args) compile with `-g`, which makes their
    build, once per fresh machine and venv, 1.6x as long (fused_adam.cpp alone: 62 s against 39 s on
    2 cores) for symbols only a native debugger reads. The flags are part of torch's hash of a JIT
    op, so the build (build_ops) and every load (the engines' configs, cpu_config) drop it alike;
    an op built with other flags is built again once, not loaded wrong."""
    try:
        from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder
    except ImportError:  # a DeepSpeed without the CPU accelerator's builders: nothing to change
        return
    if getattr(CPUOpBuilder.cxx_args, "without_debug_info", False):
        return
    flags = CPUOpBuilder.cxx_args

    def cxx_args(self):
        return [a for a in flags(self) if a != "-g"]

    cxx_args.without_debug_info = True  # type: ignore[attr-defined]
    CPUOpBuilder.cxx_args = cxx_args


def build_ops(names: list[str]) -> None:
    """Build DeepSpeed's JIT ops `names` now, into TORCH_EXTENSIONS_DIR, so that the first run does
    not spend minutes compiling (`python -m hybridrl.env`, which the setup runs after environ.setup)."""
    import os

    cpu_ops_without_debug_info()
    for name in names:
        builder = op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
            print(f"built DeepSpeed op {name} into {os.environ['TORCH_EXTENSIONS_DIR']}")


def op_report(names: list[str], cpu_names: list[str]) -> dict:
    """{"accelerator": its name, "ops": {name: {"dir", "compatible"} or None}} for `names`, plus
    `cpu_names` on the CPU accelerator (what `hybridrl doctor` reports, in a fresh interpreter)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    ops = {}
    for name in names + (cpu_names if acc.device_name() == "cpu" else []):
        b = acc.create_op_builder(name)
        ops[name] = None if b is None else {"dir": b.NAME, "compatible": bool(b.is_compatible(verbose=False))}
    return {"accelerator": acc.device_name(), "ops": ops}
