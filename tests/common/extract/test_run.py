"""Out of memory on a CPU host: the allocator's own wording is retried like CUDA's. The run's
curves in TensorBoard, resumed."""

from __future__ import annotations

import torch
from datasets import Dataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.extract.run import ExtractionRun
from common.hidden_states.state_files import list_sample_files, sample_path
from common.hidden_states.storage import StoredStates
from common.trackers import TENSORBOARD_DIR, open_trackers

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


def test_a_resumed_run_counts_on_from_the_samples_it_found_done(tmp_path):
    """Steps are samples done: a point after each batch (log_seconds=0) and the totals at the last
    step; the run resumed with two files done starts a new event file from step 2, and TensorBoard
    drops what the first run logged from there on (the purge), so each step holds one point."""
    rows = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    ds = Dataset.from_dict({"sample_id": ["a", "b", "c", "d"], "input_ids": rows, "loss_mask": [[1, 1, 1]] * 4})
    batches, lengths = [[0], [1], [2], [3]], {i: 3 for i in range(4)}
    out = tmp_path / "hs"
    trackers = open_trackers(["tensorboard"], tmp_path, "extract", start_step=0)
    ExtractionRun(OneSampleAtATime(), ds, out, show_progress=False, trackers=trackers, log_seconds=0).run(
        batches, set(), lengths)
    trackers.close()
    for i in (2, 3):  # as if killed after two files: the curves went further than the files
        sample_path(out, i).unlink()
    trackers = open_trackers(["tensorboard"], tmp_path, "extract", start_step=2)
    stats = ExtractionRun(OneSampleAtATime(), ds, out, show_progress=False, trackers=trackers, log_seconds=0).run(
        batches, {0, 1}, lengths)
    trackers.close()
    assert sorted(stats.written) == [2, 3]
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR / "extract"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["extract/bytes_written", "extract/forward_share",
                                                "extract/samples_failed", "extract/samples_written",
                                                "extract/tokens_per_s"]
    written = [(e.step, e.value) for e in events.Scalars("extract/samples_written")]
    assert [step for step, _ in written] == [1, 3, 4] and written[-1] == (4, 2)  # step 1 the first run's
    assert events.Scalars("extract/bytes_written")[-1].value == sum(sample_path(out, i).stat().st_size
                                                                     for i in (2, 3))
