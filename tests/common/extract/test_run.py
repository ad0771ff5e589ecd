"""Out of memory on a CPU host: the allocator's own wording is retried like CUDA's."""

from __future__ import annotations

import torch
from datasets import Dataset

from common.extract.run import ExtractionRun
from common.hidden_states.state_files import list_sample_files
from common.hidden_states.storage import StoredStates

CPU_ALLOCATOR = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 74490839040 bytes. "
                 "Error code 12 (Cannot allocate memory)")


class OneSampleAtATime:
    """States of width 4 for batches of one sample; the CPU allocator's error for larger ones
    (as a host whose memory holds one sample's activations, not two)."""

    forward_seconds = 0.0

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def __call__(self, id_lists: list[list[int]]) -> list[StoredStates]:
        self.batch_sizes.append(len(id_lists))
        if len(id_lists) > 1:
            raise RuntimeError(CPU_ALLOCATOR)
        n = len(id_lists[0])
        return [StoredStates([torch.full((n, 4), float(id_lists[0][0]), dtype=torch.bfloat16)] * 4, None)]


def test_a_cpu_allocator_failure_halves_the_batch(tmp_path):
    rows = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    ds = Dataset.from_dict({"sample_id": ["a", "b", "c", "d"], "input_ids": rows, "loss_mask": [[1, 1, 1]] * 4})
    extractor = OneSampleAtATime()
    run = ExtractionRun(extractor, ds, tmp_path, show_progress=False)
    stats = run.run([[0, 1, 2, 3]], set(), {i: 3 for i in range(4)})
    assert extractor.batch_sizes == [4, 2, 1, 1, 2, 1, 1]
    assert sorted(stats.written) == [0, 1, 2, 3] and stats.failed == []
    assert sorted(list_sample_files(tmp_path)) == [0, 1, 2, 3]
