"""The online source's pieces: a computed sample becomes the library's sample exactly as a loaded
file does, and the prefetch window holds at most --prefetch batches ahead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import write_hidden_states
from speculators.train.data import Eagle3SampleFileDataset
from speculators.train.noise_transforms import AddUniformNoise

from common.hidden_states.loader import ResumableBatchSampler
from common.hidden_states.state_files import list_sample_files
from common.hidden_states.storage import standardize_fn
from common.online.states import OnlineSampleDataset, PrefetchingBatchSampler


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_prepare_is_the_librarys_getitem_after_its_load(tmp_path, flat_target, storage):
    """`OnlineSampleDataset.prepare` repeats the library's `__getitem__` after `torch.load`; a
    library upgrade that changes it fails here (with the noise drawn from the same seed)."""
    files = [str(p) for p in list_sample_files(write_hidden_states(tmp_path, flat_target, 3, storage=storage)).values()]
    noise = AddUniformNoise(std=0.05, tensors=("hidden_states",))
    library = Eagle3SampleFileDataset(64, file_list=files, transform=noise, standardize_fn=standardize_fn(storage))
    ours = OnlineSampleDataset(None, [Path(f) for f in files], [48, 49, 50], 64, 64, noise, standardize_fn(storage))
    for i, path in enumerate(files):
        torch.manual_seed(i)
        theirs = library[i]
        torch.manual_seed(i)
        mine = ours.prepare(torch.load(path, weights_only=True))
        assert theirs.keys() == mine.keys()
        assert all(torch.equal(theirs[k], mine[k]) and theirs[k].dtype == mine[k].dtype for k in theirs)


class RecordingDataset(OnlineSampleDataset):
    """Records what the sampler hands to the engine, and when."""

    def __init__(self, n: int) -> None:
        self.submitted: list[list[int]] = []
        self.passes = 0
        super().__init__(None, [Path(f"data_{i}.pt") for i in range(n)], [9] * n, 8, 32, None,
                         standardize_fn("bf16"))

    def compute(self, batch: list[int]) -> dict[int, str]:
        self.submitted.append([int(i) for i in batch])
        return {i: "computed" for i in batch}

    def pass_done(self) -> None:
        self.passes += 1


def lists(batches) -> list[list[int]]:
    return [[int(i) for i in batch] for batch in batches]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_the_window_holds_at_most_prefetch_batches_ahead(prefetch):
    dataset = RecordingDataset(40)
    sampler = PrefetchingBatchSampler(dataset, prefetch, batch_max_length=32, lengths=dataset.approx_lengths,
                                      num_replicas=1, rank=0, seed=0)
    expected = lists(ResumableBatchSampler(batch_max_length=32, lengths=dataset.approx_lengths, num_replicas=1,
                                          rank=0, seed=0))
    seen = []
    for k, batch in enumerate(sampler, start=1):
        seen.append([int(i) for i in batch])
        assert k <= len(dataset.submitted) <= k + prefetch  # the one yielded, and at most N ahead
        assert all(dataset.ready.pop(i) == "computed" for i in batch)  # its states were handed over
    assert seen == expected == dataset.submitted and sampler.wait_seconds >= 0
    sampler.skip = 3  # a resumed epoch: the batches trained before are neither computed nor yielded
    dataset.submitted.clear()
    assert lists(sampler) == expected[3:] == dataset.submitted and dataset.passes == 2
