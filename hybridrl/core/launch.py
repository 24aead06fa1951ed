"""Process launch and torch.distributed setup.

`hybridrl train --nproc N` re-runs the same command under PyTorch's elastic launcher (the
machinery behind torchrun), so torchrun's multi-node flags pass straight through. Under
torchrun / `accelerate launch` the ranks given are used; from Python the calling process is
rank 0 of a world of one.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridrl.core import platform
from hybridrl.core.faults import WATCHDOG_EXIT


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_before_world_of_one: dict[str, str | None] | None = None  # what init_distributed found, to put back


def under_launcher() -> bool:
    return all(k in os.environ for k in LAUNCHER_VARS[:4])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 0) -> World:
    """Join (or create) the process group both engines share. vLLM's external_launcher and
    DeepSpeed both need it to exist before they are built. `timeout_s` > 0 bounds every
    collective (torch's default otherwise: 30 min gloo, 10 min NCCL)."""
    global _before_world_of_one
    if not under_launcher():  # notebook / plain python: a world of one (forget_world undoes the variables)
        _before_world_of_one = {k: os.environ.get(k) for k in LAUNCHER_VARS}
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, size, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cuda = platform.current().cuda
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s) if timeout_s else None,
        )
    return World(rank, size, local, device)


def set_collective_timeout(seconds: float) -> None:
    """Bound the default process group's collectives by `seconds` from now on (0: leave them as they
    are). A checkpoint's save raises it while the ranks wait for each other's shards, then puts back
    init_distributed's. torch's setter is private (distributed_c10d._set_pg_timeout, since 2.3)."""
    if seconds > 0 and dist.is_initialized() and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def forget_world() -> None:
    """Put back the variables init_distributed set for a world of one (vLLM's external launcher
    reads them while the engine is built, so they live as long as the run). Left behind, they would
    make a later `hybridrl train` started from this process (a notebook's shell cell, a test) take
    itself for a launched rank and fail to bind the port. The process group stays: DeepSpeed keeps
    references to it, and the next init_distributed reuses it. A no-op under a launcher."""
    global _before_world_of_one
    if _before_world_of_one is None:
        return
    for k, v in _before_world_of_one.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _before_world_of_one = None


def tp_group_of(rank: int, tp: int) -> tuple[int, int]:
    """(index of the tensor-parallel group holding `rank`, its place in that group): groups are
    runs of `tp` consecutive ranks, so a group sits on one node when tp divides the ranks per node."""
    return rank // tp, rank % tp


def own_slice(counts: list[int], member: int) -> slice:
    """Where a group member's items lie in the concatenation of every member's, in member order
    (`counts`: how many each member brought)."""
    start = sum(counts[:member])
    return slice(start, start + counts[member])


@dataclass
class TPGroup:
    """The ranks that share one vLLM engine (rollout.tensor_parallel_size of them). vLLM's
    external launcher runs the engine's scheduler on every rank of the group, and its model's
    collectives expect each rank to step the same batch: every request goes to every rank's engine,
    in the same order (`gather` them first), and each rank keeps its own outputs."""

    index: int  # which group (data parallelism is over groups; the group's sampling seed)
    member: int  # this rank's place in it
    size: int
    count: int  # groups in the world
    pg: object = None  # the group's process group (None: a group of one)

    def gather(self, value) -> list:
        """Every member's `value`, in member order (a list of one in a group of one)."""
        if self.size == 1:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value, group=self.pg)
        return out


def tp_groups(world: World, tp: int) -> TPGroup:
    """This rank's tensor-parallel group. Every rank creates every group (torch's new_group is
    collective over the world), so all ranks call this, in the same order."""
    if world.size % tp:
        from hybridrl.core.config import ConfigError

        raise ConfigError(
            f"rollout.tensor_parallel_size={tp} must divide the {world.size} ranks: use --nproc a multiple of {tp}"
        )
    index, member = tp_group_of(world.rank, tp)
    pg = None
    if tp > 1:
        for g in range(world.size // tp):
            made = dist.new_group(list(range(g * tp, (g + 1) * tp)))
            pg = made if g == index else pg
    return TPGroup(index, member, tp, world.size // tp, pg)


def world_size() -> int:
    """Ranks in the process group (1 before it exists)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (a no-op in a world of one)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def from_main(value):
    """Rank 0's `value` on every rank (other ranks may pass anything, e.g. None)."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value) -> list:
    """Every rank's `value`, in rank order (a list of one in a world of one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
    return [value]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def spawn(
    nproc: int,
    argv: list[str],
    *,
    nnodes: str = "1",
    node_rank: int = 0,
    rdzv_endpoint: str = "",
    rdzv_backend: str = "c10d",
    max_restarts: int = 0,
) -> int:
    """Run `python -m hybridrl <argv>` on `nproc` local ranks through torch.distributed.run."""
    from torch.distributed import run as torchrun

    args = [
        "--nproc-per-node",
        str(nproc),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--max-restarts",
        str(max_restarts),
    ]
    if rdzv_endpoint:
        args += ["--rdzv-backend", rdzv_backend, "--rdzv-endpoint", rdzv_endpoint]
    else:  # single node: a free local port, so two runs on one machine do not collide
        args += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    args += ["-m", "hybridrl", *argv]
    try:
        torchrun.run(torchrun.get_args_parser().parse_args(args))
    except Exception as e:  # ChildFailedError already printed each rank's traceback
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(e, SignalException):  # forwarded to the workers, which saved a checkpoint and stopped
            return {signal.SIGTERM: 0, signal.SIGINT: 130}.get(e.sigval, 1)
        print(f"hybridrl: {_failure_message(e)}", file=sys.stderr)
        return 1
    return 0


def _failure_message(e: Exception) -> str:
    """Name the rank that died and how, from torchrun's ChildFailedError."""
    failures = getattr(e, "failures", None) or {}
    if not failures:
        return f"a worker failed ({type(e).__name__}); see the rank's error above"
    parts = []
    for rank, f in sorted(failures.items()):
        if f.exitcode == WATCHDOG_EXIT:
            parts.append(
                f"rank {rank} (pid {f.pid}) was stopped by its watchdog (the 'hybridrl watchdog:' line "
                "above names the rank that stalled)"
            )
            continue
        how = f"killed by {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 else f"exit code {f.exitcode}"
        parts.append(f"rank {rank} (pid {f.pid}) died: {how}")
    return "; ".join(parts) + ". The other ranks were stopped; see that rank's error above."
