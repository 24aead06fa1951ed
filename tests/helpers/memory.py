"""A stand-in trainer that records the memory cycle's calls (test_memory, test_planner): a state-machine
check of the phase order, never evidence that the real engine offloads; and a small batch the real
trainer steps on (test_memory, test_deepspeed_compat)."""

import torch


def four_rows():
    """Four completions of four random demo tokens after one prompt, advantages of both signs."""
    from hybridrl.data.batch import Batch

    g = torch.Generator().manual_seed(1)
    return Batch.from_rows(
        [[1, 2, 3]] * 4,
        [torch.randint(3, 12, (4,), generator=g).tolist() for _ in range(4)],
        [[-1.0] * 4] * 4,
        [1.0, -1.0, 0.5, -0.5],
    )


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
