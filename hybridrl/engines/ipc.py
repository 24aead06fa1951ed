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
Neither side waits forever: no message from the peer for `timeout_s` (TIMEOUT_S) ends the hand-off
with a TimeoutError naming the side that went quiet, and a sender that fails mid-stream tells the
receiver to stop (an "abort" message) rather than leave it blocked in vLLM's worker, where a
cancelled future cannot reach it.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import pickle
import shutil
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable, Iterator

import torch
from torch.multiprocessing import reductions
from torch.multiprocessing.reductions import reduce_tensor

ALIGN = 256  # bytes: every tensor starts aligned, so a byte slice views as any dtype
N_BUCKETS = 2
TIMEOUT_S = 600.0  # no message from the peer for this long ends a hand-off (a ZeRO-3 bucket gathers in seconds)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (copied to contiguous first if needed)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: equal digests mean bitwise-equal tensors."""
    return hashlib.sha256(_bytes(t).cpu().numpy().tobytes()).hexdigest()


def on_device(handle, index: int):
    """A CUDA handle from `reduce_tensor`, as (rebuild function, arguments) for this process's
    device `index`: the sender's device index means nothing in the engine's process, which sees its
    one GPU as cuda:0. The index is `storage_device`, an argument of torch's private
    `rebuild_cuda_tensor`; it is found by name and the function checked, so a torch that changes
    them fails here with what to do instead of rebuilding a tensor on the wrong device."""
    fn, args = handle
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    if fn is not reductions.rebuild_cuda_tensor or "storage_device" not in names or len(args) != len(names):
        raise RuntimeError(
            f"torch {torch.__version__}: reduce_tensor's CUDA handle is not rebuild_cuda_tensor(..., "
            f"storage_device, ...) as hybridrl's out-of-process hand-off expects (got "
            f"{getattr(fn, '__name__', fn)}{tuple(names)}); use rollout.mode=inprocess with this torch"
        )
    args = list(args)
    args[names.index("storage_device")] = index
    return fn, tuple(args)


@dataclass(eq=False)  # identity: buckets are compared with `in`
class _Bucket:
    """One staging buffer of the hand-off and what has been packed into it."""

    buf: torch.Tensor  # [bucket bytes] uint8, shared by handle
    used: int = 0
    items: list = field(default_factory=list)  # (name, dtype, shape, total, part_offset, offset, nbytes)
    sent_handle: bool = False


class BucketSender:
    """The trainer's side. `send` streams named tensors (a lazy iterator is consumed once) into
    the buckets while `rpc(address, digest=..., timeout_s=...)` runs the receiver in the engine
    process."""

    def __init__(self, bucket_bytes: int, *, cuda: bool, timeout_s: float = TIMEOUT_S):
        import zmq

        self.bucket_bytes, self.cuda, self.timeout_s = bucket_bytes, cuda, timeout_s
        self.ctx = zmq.Context()
        self.dir = tempfile.mkdtemp(prefix="hybridrl-ipc-")
        # removed at close, or at exit however the run ends (an out-of-memory, an engine that died)
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.count = itertools.count()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hybridrl-handoff")

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
        # shared memory made as such (share_memory_() would allocate, then copy into shm)
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))

    def send(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], rpc: Callable[..., dict], digest: bool = False
    ) -> dict:
        """Stream `named_tensors` while `rpc(address, digest=..., timeout_s=...)` runs the receiver;
        returns the receiver's report. Raises TimeoutError when the receiver goes quiet."""
        import concurrent.futures

        import zmq

        address = f"ipc://{self.dir}/{next(self.count)}.sock"
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        future = self.pool.submit(rpc, address, digest=digest, timeout_s=self.timeout_s)
        self.stats = {"messages": 0, "bytes": 0, "tensors": 0}
        try:
            self._stream(named_tensors, sock, future)
            try:
                out = future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(
                    f"weight hand-off: the engine's receiver took every bucket but did not return "
                    f"within {self.timeout_s:.0f} s"
                ) from None
        except BaseException as e:
            try:  # the receiver stops now instead of after its timeout
                if sock.poll(1000, zmq.POLLOUT):
                    sock.send(pickle.dumps({"abort": f"{type(e).__name__}: {e}"[:500]}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            sock.close()
            future.cancel()  # only if it has not started: a running RPC ends through the abort or its timeout
            raise
        sock.close()
        return {**out, "sent": self.stats}

    def _wait(self, sock, event: int, future, what: str) -> None:
        """Until `sock` is ready for `event`; raises the receiver's error if it returned early,
        TimeoutError after `timeout_s` of silence."""
        deadline = time.monotonic() + self.timeout_s
        while not sock.poll(100, event):
            if future.done():  # the receiver stopped early: surface its error
                future.result()
                raise RuntimeError("the engine's weight receiver returned before acknowledging every bucket")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"weight hand-off: the engine's receiver {what} for {self.timeout_s:.0f} s (its "
                    "process may have died or hung); see the engine's log above"
                )

    def _stream(self, named_tensors, sock, future) -> None:
        import zmq

        slots: list[_Bucket] = []  # the (at most N_BUCKETS) buffers of this hand-off
        in_flight: list[_Bucket] = []  # sent, not yet acknowledged, oldest first

        def send(data: bytes) -> None:
            self._wait(sock, zmq.POLLOUT, future, "did not connect or stopped reading")
            sock.send(data, zmq.NOBLOCK)

        def wait_ack() -> _Bucket:
            self._wait(sock, zmq.POLLIN, future, "acknowledged nothing")
            sock.recv()
            slot = in_flight.pop(0)
            slot.items, slot.used = [], 0
            return slot

        def flush(slot: _Bucket, once: bool = False) -> None:
            if self.cuda:
                torch.cuda.current_stream().synchronize()  # the copies into the bucket have landed
            msg = {
                "slot": id(slot),
                "items": slot.items,
                "once": once,
                "handle": None if slot.sent_handle else reduce_tensor(slot.buf),
            }
            send(ForkingPickler.dumps(msg))
            slot.sent_handle = True
            in_flight.append(slot)
            self.stats["messages"] += 1

        def idle_slot() -> _Bucket:
            for s in slots:
                if s not in in_flight:
                    return s
            if len(slots) < N_BUCKETS:
                slots.append(_Bucket(self._new_buffer(self.bucket_bytes)))
                return slots[-1]
            return wait_ack()  # the oldest bucket comes back

        def put(slot: _Bucket, name: str, t: torch.Tensor, data: torch.Tensor, done: int, n: int) -> None:
            slot.buf[slot.used : slot.used + n].copy_(data[done : done + n], non_blocking=True)
            slot.items.append((name, t.dtype, tuple(t.shape), data.numel(), done, slot.used, n))
            slot.used = -(-(slot.used + n) // ALIGN) * ALIGN  # the next tensor starts aligned

        current: _Bucket | None = None
        for name, t in named_tensors:
            data = _bytes(t)  # [nbytes] uint8
            self.stats["tensors"] += 1
            self.stats["bytes"] += data.numel()
            if self.bucket_bytes == 0:  # one parameter per message, each in its own buffer
                while len(in_flight) >= N_BUCKETS:
                    wait_ack()
                slot = _Bucket(self._new_buffer(max(data.numel(), 1)))
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
        send(pickle.dumps({"done": True}))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)  # the sockets' files


class BucketReceiver:
    """The engine's side: iterate it to get (name, tensor) pairs on `device`, each its own
    copy (vLLM's layerwise loader keeps a layer's tensors until the layer is complete, and the
    sender refills a bucket as soon as it is acknowledged). `report` counts what arrived."""

    def __init__(self, address: str, device: torch.device, digest: bool = False, timeout_s: float = TIMEOUT_S):
        self.address, self.device, self.digest, self.timeout_s = address, torch.device(device), digest, timeout_s
        self.report: dict = {"tensors": 0, "bytes": 0, "messages": 0, "digests": {}}

    def _open(self, handle) -> torch.Tensor:
        if self.device.type == "cuda":  # the sender's device index means nothing here
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            fn, args = on_device(handle, index)
            return fn(*args)
        fn, args = handle
        return fn(*args)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        sock.connect(self.address)

        def recv() -> dict:
            try:
                msg = pickle.loads(sock.recv())
            except zmq.Again:
                raise TimeoutError(
                    f"weight hand-off: no message from the trainer for {self.timeout_s:.0f} s on "
                    f"{self.address} (its process may have died or hung); this hand-off is "
                    "abandoned"
                ) from None
            if "abort" in msg:
                raise RuntimeError(f"weight hand-off aborted by the trainer: {msg['abort']}")
            return msg

        buckets: dict[int, torch.Tensor] = {}
        partial: dict[str, torch.Tensor] = {}  # parameters split across fills, being assembled
        try:
            while True:
                msg = recv()
                if msg.get("done"):
                    break
                if msg["handle"] is not None:
                    buckets[msg["slot"]] = self._open(msg["handle"])
                buf = buckets[msg["slot"]]
                ready = []
                for name, dtype, shape, total, part, offset, n in msg["items"]:
                    if part == 0 and n == total:  # whole tensor in this fill
                        ready.append((name, buf[offset : offset + n].view(dtype).view(shape).clone()))
                        continue
                    whole = partial.setdefault(name, torch.empty(total, dtype=torch.uint8, device=buf.device))
                    whole[part : part + n].copy_(buf[offset : offset + n])
                    if part + n == total:
                        ready.append((name, partial.pop(name).view(dtype).view(shape)))
                if msg["once"]:
                    del buckets[msg["slot"]]
                if buf.is_cuda:
                    torch.cuda.current_stream().synchronize()  # our copies are done: the bucket may be refilled
                try:
                    sock.send(b"ack")
                except zmq.Again:
                    raise TimeoutError(
                        f"weight hand-off: the trainer took no acknowledgement for "
                        f"{self.timeout_s:.0f} s on {self.address} (its process may have died or "
                        "hung)"
                    ) from None
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
