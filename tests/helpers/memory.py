"""A stand-in trainer that records the memory cycle's calls (test_memory, test_planner): a state-machine
check of the phase order, never evidence that the real engine offloads."""

import torch


class FakeTrainer:
    names = ["embed", "layer.0", "layer.1", "head"]
    compute_dtype = torch.float32

    def __init__(self, events):
        self.events = events

    def offload(self, params=False):
        self.events.append(("trainer.offload", params))

    def reload(self):
        self.events.append(("trainer.reload",))

    def named_parameters_for_sync(self, bucket_bytes):
        return ((n, torch.zeros(2)) for n in self.names)
