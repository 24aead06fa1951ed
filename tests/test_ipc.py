"""The out-of-process hand-off's failure paths (hybridrl/engines/ipc.py), on CPU with real ZeroMQ sockets:
neither side blocks forever on a peer that died, went quiet or never came, a sender that fails
mid-stream stops the receiver at once, and the CUDA handle's device argument is found by name and
checked. (The bitwise transport itself: test_memory.py; with vLLM's engine: test_outofprocess.py.)"""

import threading
import time

import pytest
import torch
import zmq
from torch.multiprocessing import reductions

from hybridrl.engines import ipc

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

T = 1.0  # seconds: the timeout these tests run with (the default is ipc.TIMEOUT_S)


def _address(tmp_path, name="x"):
    return f"ipc://{tmp_path}/{name}.sock"


@pytest.mark.parametrize("peer", ["silent", "closed"])
def test_receiver_gives_up_on_a_silent_or_closed_trainer(tmp_path, peer):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(_address(tmp_path))
    if peer == "closed":  # the trainer's process died before sending anything
        sock.close(linger=0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no message from the trainer for 1 s on ipc://.*abandoned"):
        list(ipc.BucketReceiver(_address(tmp_path), "cpu", timeout_s=T))
    assert T <= time.monotonic() - t0 < T + 4  # not forever, not at once
    ctx.destroy(linger=0)


def _sender_against(rpc):
    sender = ipc.BucketSender(1 << 20, cuda=False, timeout_s=T)
    t0 = time.monotonic()
    try:
        sender.send(iter([("w", torch.arange(10.0))]), rpc)
    finally:
        elapsed = time.monotonic() - t0
        sender.close()
    return elapsed


def test_sender_gives_up_on_a_receiver_that_never_connects():
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"receiver did not connect or stopped reading for 1 s"):
            _sender_against(lambda address, **kw: release.wait(30))  # an engine that never runs the receiver
    finally:
        release.set()


def test_sender_gives_up_on_a_receiver_that_stops_acknowledging():
    release, got = threading.Event(), []

    def rpc(address, **kw):  # reads the first bucket, then hangs (a stuck weight loader)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(address)
        got.append(sock.recv())
        release.wait(30)
        ctx.destroy(linger=0)

    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"receiver acknowledged nothing for 1 s"):
            _sender_against(rpc)
    finally:
        release.set()
    assert len(got) == 1 and time.monotonic() - t0 < T + 4


def test_a_failing_sender_stops_the_receiver_at_once():
    """The trainer's side raises mid-stream (a ZeRO-3 gather that failed): the receiver, here with
    a 60 s timeout, learns it from an abort message and ends within a second or two."""
    ended = {}

    def rpc(address, digest, timeout_s):
        t0 = time.monotonic()
        try:
            list(ipc.BucketReceiver(address, "cpu", digest=digest, timeout_s=60))
        except Exception as e:
            ended["error"] = e
        ended["after_s"] = time.monotonic() - t0

    def params():
        yield "w", torch.arange(10.0)
        raise ValueError("gather failed on rank 1")

    sender = ipc.BucketSender(1 << 20, cuda=False, timeout_s=60)
    try:
        with pytest.raises(ValueError, match="gather failed"):
            sender.send(params(), rpc)
        sender.pool.shutdown(wait=True)  # the receiver's thread has returned
    finally:
        sender.close()
    assert isinstance(ended["error"], RuntimeError), ended
    assert str(ended["error"]) == "weight hand-off aborted by the trainer: ValueError: gather failed on rank 1"
    assert ended["after_s"] < 5


def test_cuda_handle_device_argument_is_found_by_name_and_checked():
    """reduce_tensor's CUDA handle is (rebuild_cuda_tensor, its 15 arguments); the receiver puts its
    own device index into `storage_device`, which torch 2.13 has 7th. A torch whose handle differs
    fails with the fix instead of rebuilding on the sender's device."""
    fn, args = ipc.on_device((reductions.rebuild_cuda_tensor, tuple(range(15))), 3)
    assert fn is reductions.rebuild_cuda_tensor and args == (0, 1, 2, 3, 4, 5, 3, 7, 8, 9, 10, 11, 12, 13, 14)

    def rebuild_cuda_tensor(tensor_cls, tensor_size, storage_handle):  # a changed signature
        pass

    for handle in [(rebuild_cuda_tensor, (1, 2, 3)), (reductions.rebuild_cuda_tensor, tuple(range(14)))]:
        with pytest.raises(RuntimeError, match="use rollout.mode=inprocess with this torch"):
            ipc.on_device(handle, 0)
