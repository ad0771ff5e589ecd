"""Step 02's run loop: the planned batches of one shard through an engine (common/extract/engines.py),
each sample's states written as its `data_{i}.pt` by writer threads while the next batch runs, and
what went wrong counted. A batch out of memory is run again in halves down to single samples; a
sample out of memory alone is skipped and listed, up to a limit; any other error stops the run.
04 --online runs the same `ExtractionRun` (its `load` and `extract`) for each training batch.

Given trackers (common/trackers.py; 02's `--report-to`), the run reports its progress as scalars
(`ExtractionRun.run` says which, at which steps).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from common.errors import PipelineError, first_line, skip_limit
from common.hidden_states.journal import Journal, ids_digest
from common.hidden_states.state_files import file_digest, sample_path, save_sample
from common.hidden_states.storage import StoredStates
from common.trackers import Trackers

WRITE_THREADS = 4  # file writes overlap the next forward pass
MAX_PENDING_WRITES = 64  # bounds the host memory held by finished, unwritten samples
# Skipping is for the odd bad sample; past `common.errors.skip_limit` or this many in a row the failures
# are systematic (a bug, a device that is out of memory on every sample) and the run stops.
MAX_SKIPPED_IN_A_ROW = 20
LOG_SECONDS = 10.0  # at most one point of the trackers' curves per this many seconds, and always the last


class Extractor(Protocol):
    """An engine of common/extract/engines.py: `StateExtractor` (hf) or `VllmStateExtractor`."""

    forward_seconds: float  # spent computing states so far

    def __call__(self, id_lists: list[list[int]]) -> list[StoredStates]: ...


@dataclass
class Sample:
    index: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class ExtractStats:
    written: dict[int, int] = field(default_factory=dict)  # index -> tokens
    failed: list[dict] = field(default_factory=list)  # {"index", "sample_id", "error"}
    file_bytes: int = 0
    state_bytes: int = 0  # bytes of the hidden-state tensors alone
    forward_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(self.written.values())


def _free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# How an allocator says it is out of memory: CUDA's, and the CPU's ("DefaultCPUAllocator: can't
# allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)").
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _is_out_of_memory(error: RuntimeError | MemoryError) -> bool:
    text = str(error).lower()
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or any(w in text for w in OUT_OF_MEMORY_WORDS)


class ExtractionRun:
    """Extracts the planned batches of one shard into `out`, skipping the indices in `done`."""

    def __init__(self, extractor: Extractor, ds, out: Path, show_progress: bool = True,
                 journal: Journal | None = None, trackers: Trackers | None = None,
                 log_seconds: float = LOG_SECONDS) -> None:
        self.extractor = extractor
        self.trackers = trackers or Trackers([])  # told the run's progress (`run`); none by default
        self.log_seconds = log_seconds
        self.journal = journal  # told of every file once it is in place (the next resume reads it)
        self.digests: dict[int, str] = {}  # ids digest of each sample being written
        self.rows = ds.select_columns(["sample_id", "input_ids", "loss_mask"])
        self.out = out
        self.show_progress = show_progress
        self.stats = ExtractStats()
        self.skip_limit = skip_limit(0)
        self.skipped_in_a_row = 0

    def run(self, batches: list[list[int]], done: set[int], lengths: dict[int, int]) -> ExtractStats:
        """Extract every sample of `batches` not in `done`. With trackers, after a batch (at most one
        point per `log_seconds`) and once at the end with the run's totals, it logs
        `extract/tokens_per_s` (tokens through the target / wall seconds since the run began; at the end
        the tokens of the files written, as 02 prints it),
        `extract/samples_written` and `extract/samples_failed` (this run's samples), `extract/bytes_written`
        (bytes of this run's files in place) and `extract/forward_share` (the engine's forward seconds /
        wall seconds), at step = samples of the batches done: those found done before the run began
        (`done`) plus those this run extracted or skipped, so a resumed run's steps count on from
        where its files left off (and its last step is the number of samples of the shard)."""
        todo_tokens = sum(lengths[i] for batch in batches for i in batch if i not in done)
        todo_samples = sum(i not in done for batch in batches for i in batch)
        self.skip_limit = skip_limit(todo_samples)
        step = sum(i in done for batch in batches for i in batch)  # samples done, found done first
        last_step = step + todo_samples
        tokens = 0  # extracted (or skipped) by this run
        start = last_log = time.perf_counter()
        last_log -= self.log_seconds  # the first batch is logged
        pending: deque[Future] = deque()
        bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="extract", disable=not self.show_progress,
                   smoothing=0.05)
        with ThreadPoolExecutor(WRITE_THREADS) as pool:
            for batch in batches:
                todo = [i for i in batch if i not in done]
                if not todo:
                    continue
                # The whole planned batch runs again even if some of it is done, so a resumed run
                # computes exactly what an uninterrupted one would.
                for sample, states in self.extract(self.load(batch)):
                    if sample.index in todo:
                        self.digests[sample.index] = ids_digest(sample.input_ids)
                        pending.append(pool.submit(_write, self.out, sample, states))
                while len(pending) > MAX_PENDING_WRITES:
                    self._collect(pending.popleft())
                bar.update(sum(lengths[i] for i in todo))
                bar.set_postfix(written=len(self.stats.written) + len(pending), failed=len(self.stats.failed))
                step += len(todo)
                tokens += sum(lengths[i] for i in todo)
                now = time.perf_counter()
                if self.trackers and step < last_step and now - last_log >= self.log_seconds:
                    self._report(step, tokens, now - start)
                    last_log = now
            while pending:
                self._collect(pending.popleft())
        bar.close()
        self.stats.forward_seconds = self.extractor.forward_seconds
        self.stats.seconds = time.perf_counter() - start
        if self.trackers and todo_samples:
            self._report(last_step, self.stats.tokens, self.stats.seconds)  # 02's closing figures
        return self.stats

    def _report(self, step: int, tokens: int, seconds: float) -> None:
        """The scalars of `run` so far, at `step`."""
        seconds = max(seconds, 1e-9)
        self.trackers.log({"extract/tokens_per_s": tokens / seconds,
                           "extract/samples_written": len(self.stats.written),
                           "extract/samples_failed": len(self.stats.failed),
                           "extract/bytes_written": self.stats.file_bytes,
                           "extract/forward_share": self.extractor.forward_seconds / seconds}, step)

    def load(self, batch: list[int]) -> list[Sample]:
        """The prepared rows of `batch`; a row whose ids and mask differ in length is skipped and listed."""
        rows = self.rows[batch]
        samples = [Sample(i, str(sid), ids, mask) for i, sid, ids, mask
                   in zip(batch, rows["sample_id"], rows["input_ids"], rows["loss_mask"])]
        good = []
        for sample in samples:
            if not sample.input_ids or len(sample.loss_mask) != len(sample.input_ids):
                self._fail(sample, f"{len(sample.input_ids)} input ids but {len(sample.loss_mask)} loss-mask entries")
            else:
                good.append(sample)
        return good

    def extract(self, samples: list[Sample]) -> list[tuple[Sample, StoredStates]]:
        """The batch's states. Out of memory, the batch is split in halves down to single samples,
        and a sample out of memory alone is skipped and listed; any other error stops the run."""
        if not samples:
            return []
        try:
            states = self.extractor([s.input_ids for s in samples])
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            if not _is_out_of_memory(error):
                ids = ", ".join(s.sample_id for s in samples[:3]) + (", ..." if len(samples) > 3 else "")
                raise PipelineError(f"extraction failed on samples {ids}: {first_line(error)} "
                                    "(only out-of-memory errors are retried)") from error
            _free_device_memory()
            if len(samples) == 1:
                self._fail(samples[0], first_line(error))
                return []
            half = len(samples) // 2
            return self.extract(samples[:half]) + self.extract(samples[half:])
        self.skipped_in_a_row = 0
        return list(zip(samples, states))

    def _fail(self, sample: Sample, error: str) -> None:
        """Skip and list one sample; stop the run when skipping stops being the exception."""
        self.stats.failed.append({"index": sample.index, "sample_id": sample.sample_id, "error": error})
        self.skipped_in_a_row += 1
        tqdm.write(f"skipped sample {sample.sample_id} (row {sample.index}): {error}")
        failed = len(self.stats.failed)
        if failed > self.skip_limit or self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise PipelineError(f"{failed} samples skipped ({self.skipped_in_a_row} in a row, limit {self.skip_limit} "
                                f"in all and {MAX_SKIPPED_IN_A_ROW} in a row); the last, {sample.sample_id} "
                                f"(row {sample.index}): {error}. Files written so far are kept")

    def _collect(self, future: Future) -> None:
        """Account for one finished write (in the main thread; a write error stops the run)."""
        index, tokens, file_bytes, state_bytes, digest = future.result()
        self.stats.written[index] = tokens
        if self.journal is not None:
            self.journal.add(index, file_bytes, self.digests.pop(index), digest)
        self.stats.file_bytes += file_bytes
        self.stats.state_bytes += state_bytes


def _write(out: Path, sample: Sample, stored: StoredStates) -> tuple[int, int, int, int, str]:
    """Runs in a writer thread: (index, tokens, file bytes, hidden-state bytes incl. scales, the
    file's digest for the journal: `02 --verify` checks it; re-read from the page cache, a small
    cost beside the forward pass)."""
    size = save_sample(out, sample.index, torch.tensor(sample.input_ids, dtype=torch.long), stored.states,
                       torch.tensor(sample.loss_mask, dtype=torch.long), stored.scales)
    return sample.index, len(sample.input_ids), size, stored.nbytes, file_digest(sample_path(out, sample.index))
