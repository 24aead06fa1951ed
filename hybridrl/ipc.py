"""Weight hand-off to an engine in another process: fixed-size staging buckets shared by handle.

The trainer copies parameters into a few staging buckets of `train.sync_bucket_mb` (a parameter
larger than a bucket is split across consecutive fills), and sends each bucket's handle once per
hand-off with `torch.multiprocessing.reductions.reduce_tensor` (CUDA IPC on GPU, shared memory on
CPU, so CPU tests run the same protocol), then one small message per fill saying which parameter
bytes sit where, over a local ZeroMQ socket (zmq comes with vLLM). The receiver, inside vLLM's
engine process, copies each tensor out and acknowledges, so the sender refills that bucket while
vLLM loads the previous one (two buckets: double buffering). verl and NeMo-RL use one or two
buckets per hand-off; OpenRLHF sends one handle per parameter, which `bucket_bytes=0` reproduces
here (for the comparison in bench/memory.py).

Messages are pickles between two processes of the same run, on a socket in a private temp dir.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import reduce_tensor

ALIGN = 256  # bytes: every tensor starts aligned, so a byte slice views as any dtype
N_BUCKETS = 2


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (copied to contiguous first if needed)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: equal digests mean bitwise-equal tensors."""
    return hashlib.sha256(_bytes(t).cpu().numpy().tobytes()).hexdigest()


@dataclass(eq=False)  # identity: slots are compared with `in`
class _Slot:
    buf: torch.Tensor  # [bucket bytes] uint8, shared by handle
    used: int = 0
    items: list = field(default_factory=list)  # (name, dtype, shape, total, part_offset, offset, nbytes)
    sent_handle: bool = False


class BucketSender:
    """The trainer's side. `send` streams named tensors (a lazy iterator is consumed once) into
    the buckets while `rpc(address, digest=...)` runs the receiver in the engine process."""

    def __init__(self, bucket_bytes: int, *, cuda: bool):
        import zmq

        self.bucket_bytes, self.cuda = bucket_bytes, cuda
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="hybridrl-ipc-")
        self.count = itertools.count()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hybridrl-handoff")

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
        # shared memory made as such (share_memory_() would allocate, then copy into shm)
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], rpc: Callable[..., dict],
             digest: bool = False) -> dict:
        import zmq

        address = f"ipc://{self.dir}/{next(self.count)}.sock"
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        future = self.pool.submit(rpc, address, digest=digest)
        self.stats = {"messages": 0, "bytes": 0, "tensors": 0}
        try:
            self._stream(named_tensors, sock, future)
            out = future.result()
        except BaseException:
            sock.close()  # the receiver's next recv fails rather than waits
            future.cancel()
            raise
        sock.close()
        return {**out, "sent": self.stats}

    def _stream(self, named_tensors, sock, future) -> None:
        slots: list[_Slot] = []  # the (at most N_BUCKETS) buffers of this hand-off
        in_flight: list[_Slot] = []  # sent, not yet acknowledged, oldest first

        def wait_ack() -> _Slot:
            while not sock.poll(100):
                if future.done():  # the receiver stopped early: surface its error
                    future.result()
                    raise RuntimeError("the engine's weight receiver returned before acknowledging every bucket")
            sock.recv()
            slot = in_flight.pop(0)
            slot.items, slot.used = [], 0
            return slot

        def flush(slot: _Slot, once: bool = False) -> None:
            if self.cuda:
                torch.cuda.current_stream().synchronize()  # the copies into the bucket have landed
            msg = {"slot": id(slot), "items": slot.items, "once": once,
                   "handle": None if slot.sent_handle else reduce_tensor(slot.buf)}
            sock.send(ForkingPickler.dumps(msg))
            slot.sent_handle = True
            in_flight.append(slot)
            self.stats["messages"] += 1

        def idle_slot() -> _Slot:
            for s in slots:
                if s not in in_flight:
                    return s
            if len(slots) < N_BUCKETS:
                slots.append(_Slot(self._new_buffer(self.bucket_bytes)))
                return slots[-1]
            return wait_ack()  # the oldest bucket comes back

        def put(slot: _Slot, name: str, t: torch.Tensor, data: torch.Tensor, done: int, n: int) -> None:
            slot.buf[slot.used: slot.used + n].copy_(data[done: done + n], non_blocking=True)
            slot.items.append((name, t.dtype, tuple(t.shape), data.numel(), done, slot.used, n))
            slot.used = -(-(slot.used + n) // ALIGN) * ALIGN  # the next tensor starts aligned

        current: _Slot | None = None
        for name, t in named_tensors:
            data = _bytes(t)  # [nbytes] uint8
            self.stats["tensors"] += 1
            self.stats["bytes"] += data.numel()
            if self.bucket_bytes == 0:  # one parameter per message, each in its own buffer
                while len(in_flight) >= N_BUCKETS:
                    wait_ack()
                slot = _Slot(self._new_buffer(max(data.numel(), 1)))
                put(slot, name, t, data, 0, data.numel())
                flush(slot, once=True)
                continue
            done = 0
            while True:  # a tensor larger than the free space continues in the next fill
                if current is None:
                    current = idle_slot()
                n = min(data.numel() - done, current.buf.numel() - current.used)
                put(current, name, t, data, done, n)
                done += n
                if current.used >= current.buf.numel():
                    flush(current)
                    current = None
                if done == data.numel():
                    break
        if current is not None and current.items:
            flush(current)
        while in_flight:
            wait_ack()
        sock.send(pickle.dumps({"done": True}))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)  # the sockets' files


class BucketReceiver:
    """The engine's side: iterate it to get (name, tensor) pairs on `device`, each its own
    copy (vLLM's layerwise loader keeps a layer's tensors until the layer is complete, and the
    sender refills a bucket as soon as it is acknowledged). `report` counts what arrived."""

    def __init__(self, address: str, device: torch.device, digest: bool = False):
        self.address, self.device, self.digest = address, torch.device(device), digest
        self.report: dict = {"tensors": 0, "bytes": 0, "messages": 0, "digests": {}}

    def _open(self, handle) -> torch.Tensor:
        fn, args = handle
        if self.device.type == "cuda":  # the sender's device index means nothing here
            args = list(args)
            args[6] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return fn(*args)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        buckets: dict[int, torch.Tensor] = {}
        partial: dict[str, torch.Tensor] = {}  # parameters split across fills, being assembled
        try:
            while True:
                msg = pickle.loads(sock.recv())
                if msg.get("done"):
                    break
                if msg["handle"] is not None:
                    buckets[msg["slot"]] = self._open(msg["handle"])
                buf = buckets[msg["slot"]]
                ready = []
                for name, dtype, shape, total, part, offset, n in msg["items"]:
                    if part == 0 and n == total:  # whole tensor in this fill
                        ready.append((name, buf[offset: offset + n].view(dtype).view(shape).clone()))
                        continue
                    whole = partial.setdefault(name, torch.empty(total, dtype=torch.uint8, device=buf.device))
                    whole[part: part + n].copy_(buf[offset: offset + n])
                    if part + n == total:
                        ready.append((name, partial.pop(name).view(dtype).view(shape)))
                if msg["once"]:
                    del buckets[msg["slot"]]
                if buf.is_cuda:
                    torch.cuda.current_stream().synchronize()  # our copies are done: the bucket may be refilled
                sock.send(b"ack")
                self.report["messages"] += 1
                for name, t in ready:
                    self.report["tensors"] += 1
                    self.report["bytes"] += t.numel() * t.element_size()
                    if self.digest:
                        self.report["digests"][name] = digest(t)
                    yield name, t
            if partial:
                raise RuntimeError(f"hand-off ended with parameters incomplete: {sorted(partial)}")
        finally:
            buckets.clear()
            sock.close()
            ctx.term()
