"""The receiving process of tests/test_memory.py's transport test. Its own module so that a
spawned child imports only torch, zmq and hybridrl.engines.ipc (not vLLM)."""

from hybridrl.engines import ipc


def receive_many(addresses, results):
    """One BucketReceiver per address put on `addresses` (None stops), reports on `results`."""
    for address in iter(addresses.get, None):
        r = ipc.BucketReceiver(address, "cpu", digest=True)
        names = [n for n, _ in r]
        results.put({**r.report, "names": names})
