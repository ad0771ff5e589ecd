"""04 `--online`: the target computes each batch's hidden states while the draft trains, instead
of 02 writing them all to disk first (500K Kimi-K2.5 conversations of 2,048 tokens hold 59 TB of
states in bf16).

The training data is the offline one with another source (`OnlineStates`, a `HiddenStateData`):
one item per prepared row of 01, named by the file 02 would write for it, with its length from
01's ids, so the split by prepared row, the library's packing sampler, the noise, the collate and
resume see what they see offline. For each batch the sampler draws, `PrefetchingBatchSampler` has
the engine compute the batch's states (02's `ExtractionRun` over the engine `open_state_engine`
opens: the same layer ids, compute dtype and storage rounding as 02's files, an out-of-memory batch
split, a sample that cannot be extracted skipped and counted), up to `--prefetch` batches ahead in
one background thread. The dataset turns them into the library's sample exactly as it turns a
loaded file (`OnlineSampleDataset.prepare`), in the training thread and in order, so the noise
draws the same random numbers: given the same states, the draft is bitwise the offline one.

`--max-disk SIZE` keeps some of the states as 02's files (common/online/kept.py). `open_states` opens
04's source of states: 02's folder, or (--online, common/online/options.py) the engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from speculators.train.data import shift_batch

from common.engine_device import Runtime
from common.errors import PipelineError, first_line, skip_limit
from common.extract.batches import DEFAULT_BATCH_TOKENS, check_token_ids, plan_batches
from common.extract.engines import open_state_engine
from common.extract.run import ExtractionRun, Sample
from common.hidden_states.data_config import new_data_config
from common.hidden_states.loader import HiddenStateData, LoaderSettings, ResumableBatchSampler, load_hidden_states
from common.hidden_states.skip_damaged import CheckedSampleDataset, SkipTally
from common.hidden_states.state_files import sample_index, sample_path
from common.hidden_states.storage import SCALES_KEY, STORAGES, StateStorage, StoredStates, standardize_fn
from common.online.kept import KeptStates
from common.online.options import DEFAULT_PREFETCH, OnlineOptions
from common.prepare.prepared_dataset import check_prepared_target, load_prepared
from common.target.config import TargetInfo, choose_layer_ids

__all__ = ["OnlineStates", "StateEngineError", "open_online_states", "open_states"]


class NotExtracted(Exception):
    """A sample the engine could not compute (02's reason, e.g. out of memory alone)."""


class StateEngineError(PipelineError):
    """The engine computing the states failed (died, or a sample's failure was not one to skip)."""


def raw_sample(sample: Sample, stored: StoredStates) -> dict[str, Any]:
    """What torch.load returns for the file 02 would write for `sample` (`save_sample`)."""
    data = {"input_ids": torch.tensor(sample.input_ids, dtype=torch.long), "hidden_states": stored.states,
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.long)}
    if stored.scales is not None:
        data[SCALES_KEY] = stored.scales
    return data


@dataclass
class OnlineStates(HiddenStateData):
    """The states of 01's prepared rows, computed by the engine batch by batch (see the module
    docstring). `lengths` is keyed by the file 02 would write for each row."""

    run: ExtractionRun | None = None
    engine: str = ""  # names the engine in errors
    storage: StateStorage | None = None
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    prefetch: int = DEFAULT_PREFETCH
    kept: KeptStates | None = None
    compute_seconds: float = 0.0
    computed_samples: int = 0
    failed: dict[int, str] = field(default_factory=dict)  # row -> why its states could not be computed

    def dataset(self, files: list[Path], max_len: int, transform: Callable | None) -> CheckedSampleDataset:
        return OnlineSampleDataset(self, files, [self.lengths[Path(f)] for f in files], self.config.hidden_size,
                                   max_len, transform, standardize_fn(self.config.storage))

    def batch_sampler(self, dataset: CheckedSampleDataset, **kwargs: Any) -> ResumableBatchSampler:
        return PrefetchingBatchSampler(dataset, self.prefetch, lengths=dataset.approx_lengths, **kwargs)

    def num_workers(self, settings: LoaderSettings) -> int:
        return 0  # the states arrive in this process; the engine is the work

    def skip_tally(self, files: list[Path] | None = None) -> SkipTally:
        files = self.files if files is None else files
        return SkipTally(len(files), "samples", "their rows are listed in train_report.json")

    def summary(self) -> dict[str, Any]:
        """For train_report.json."""
        return {"engine": self.engine, "prefetch": self.prefetch, "batch_tokens": self.batch_tokens,
                "layer_ids": self.config.layer_ids, "storage": self.config.storage,
                "computed_samples": self.computed_samples, "compute_seconds": round(self.compute_seconds, 3),
                "failed_rows": {str(r): why for r, why in sorted(self.failed.items())},
                "kept_samples": len(self.kept.kept) if self.kept else 0, "kept_bytes": self.kept.used if self.kept else 0,
                "kept_folder": str(self.folder) if self.kept else None}

    def describe(self) -> str:
        rate = self.computed_samples / self.compute_seconds if self.compute_seconds else 0.0
        return (f"online: {self.engine} computed the states of {self.computed_samples:,} samples in "
                f"{self.compute_seconds:,.1f}s ({rate:,.1f} samples/s)"
                + (f"; {self.kept.describe()}" if self.kept else "; none kept on disk (--max-disk 0)"))

    def compute(self, rows: list[int]) -> dict[int, dict[str, Any] | str]:
        """Per row not kept on disk: its sample as 02's file would hold it, or why there is none.
        The rows run in batches of similar length under `batch_tokens`, as 02 runs them."""
        start = time.perf_counter()
        found: dict[int, dict[str, Any] | str] = {r: self.failed[r] for r in rows if r in self.failed}  # not retried
        lengths = {r: self.lengths[sample_path(self.folder, r)] for r in rows
                   if r not in found and (self.kept is None or r not in self.kept.kept)}
        for batch in plan_batches(lengths, self.batch_tokens):
            for sample, stored in self.run.extract(self.run.load(batch)):
                found[sample.index] = raw_sample(sample, stored)
                if self.kept is not None:
                    self.kept.keep(sample, stored, self.storage)
        for failure in self.run.stats.failed:
            if failure["index"] in lengths and failure["index"] not in found:
                found[failure["index"]] = self.failed[failure["index"]] = failure["error"]
        self.compute_seconds += time.perf_counter() - start
        self.computed_samples += len(lengths)
        return found


class OnlineSampleDataset(CheckedSampleDataset):
    """The library's dataset over prepared rows: a row's states come from the engine (handed over
    by the sampler in `ready`) or, kept by `--max-disk`, from its file as offline."""

    def __init__(self, states: OnlineStates, files: list[Path], lengths: list[int], hidden_size: int, max_len: int,
                 transform: Callable | None, standardize: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.states = states
        self.rows = [sample_index(f) for f in files]
        self.ready: dict[int, dict[str, Any] | str] = {}  # dataset index -> raw sample, or why there is none
        super().__init__(files, lengths, hidden_size, max_len, transform, standardize)

    def compute(self, batch: list[int]) -> dict[int, dict[str, Any] | str]:
        """Runs in the prefetch thread: the raw samples of dataset indices `batch`."""
        by_row = self.states.compute([self.rows[i] for i in batch])
        return {i: by_row[self.rows[i]] for i in batch if self.rows[i] in by_row}

    def pass_done(self) -> None:
        """At the end of a pass (or its interruption): the files kept so far listed as 02 lists them."""
        if self.states.kept is not None:
            self.states.kept.publish()

    def load(self, index: int) -> dict[str, Any]:
        raw = self.ready.pop(index, None)
        if raw is None:  # kept on disk
            return super().load(index)
        if isinstance(raw, str):
            raise NotExtracted(raw)
        return self.prepare(raw)

    def name(self, index: int) -> str:
        kept = self.states.kept is not None and self.rows[index] in self.states.kept.kept
        return str(self.data[index]) if kept else f"prepared row {self.rows[index]}"

    def failure(self, error: Exception) -> str:
        return f"its states could not be computed ({error})" if isinstance(error, NotExtracted) else super().failure(error)

    def prepare(self, data: dict[str, Any]) -> dict[str, Any]:
        """The library's `Eagle3SampleFileDataset.__getitem__` after its `torch.load` (speculators
        0.3.0; tests/common/online/test_states.py holds the two equal): standardize, cast the
        states, add lengths and positions, transform (the noise), shift inputs and targets."""
        data = self.standardize_fn(data)
        data = {k: v.to(self.hidden_states_dtype) if "hidden_states" in k else v for k, v in data.items()}
        seq_len = data["input_ids"].shape[0]
        data["lengths"] = torch.tensor([seq_len], dtype=torch.long)
        data["position_ids"] = torch.arange(seq_len, dtype=torch.long)
        if self.transform:
            data = self.transform(data)
        return shift_batch(data)


class PrefetchingBatchSampler(ResumableBatchSampler):
    """The library's packing sampler (resumable), handing each batch's rows to the engine
    `prefetch` batches ahead of the one training, in one background thread, and the computed
    states to the dataset when the batch is yielded. `wait_seconds`: the time the last pass waited
    for states the engine had not finished."""

    def __init__(self, dataset: OnlineSampleDataset, prefetch: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset, self.prefetch = dataset, prefetch
        self.wait_seconds = 0.0

    def __iter__(self) -> Iterator[list[int]]:
        batches = super().__iter__()
        self.wait_seconds = 0.0
        pool = ThreadPoolExecutor(1, thread_name_prefix="hidden-states")
        window: deque[tuple[list[int], Future]] = deque()

        def submit() -> None:
            batch = next(batches, None)
            if batch is not None:
                window.append((batch, pool.submit(self.dataset.compute, batch)))

        try:
            for _ in range(self.prefetch):
                submit()
            while window:
                batch, future = window.popleft()
                start = time.perf_counter()
                self.dataset.ready.update(self._result(future, batch))
                self.wait_seconds += time.perf_counter() - start
                submit()
                yield batch
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.dataset.pass_done()

    def _result(self, future: Future, batch: list[int]) -> dict[int, dict[str, Any] | str]:
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - whatever the engine raised ends the run in one line
            rows = [self.dataset.rows[i] for i in batch]
            what = str(e) if isinstance(e, PipelineError) else first_line(e)
            raise StateEngineError(f"{self.dataset.states.engine} failed computing the hidden states of prepared rows "
                                   f"{', '.join(map(str, rows[:4]))}{', ...' if len(rows) > 4 else ''}: {what}") from e


@contextmanager
def open_online_states(prepared_dir: Path, folder: Path, info: TargetInfo, runtime: Runtime, trust_remote_code: bool,
                       layer_ids: list[int], storage: StateStorage, batch_tokens: int, prefetch: int, max_disk: int,
                       max_samples: int | None, scratch: Path, rank: int, world_size: int,
                       gpu_memory_utilization: float | None = None) -> Iterator[OnlineStates]:
    """01's prepared rows (checked against the target as 02 checks them) with the engine of
    `runtime` open to compute their states, for the `with` block. `folder` is where 02 would
    write them, and where `--max-disk` keeps some."""
    if prefetch < 1:
        raise PipelineError(f"--prefetch {prefetch}: must be at least 1 (the batch after the one training)")
    ds, report = load_prepared(prepared_dir)
    check_prepared_target(report, prepared_dir, info.path, info.vocab_size)
    num_rows = min(len(ds), max_samples or len(ds))
    lengths = dict(enumerate(check_token_ids(ds, num_rows, info.vocab_size)))
    config = new_data_config(info, layer_ids, runtime.compute_dtype, prepared_dir, report, storage)
    kept = KeptStates(folder, config, max_disk, lengths, rank, world_size) if max_disk > 0 else None
    with open_state_engine(runtime, info, trust_remote_code, layer_ids, storage, scratch, max(lengths.values()),
                           batch_tokens, (rank, world_size), gpu_memory_utilization) as extractor:
        run = ExtractionRun(extractor, ds, folder, show_progress=False)
        run.skip_limit = skip_limit(num_rows)
        yield OnlineStates(folder, config, {sample_path(folder, i): n for i, n in lengths.items()}, run=run,
                           engine=f"the target's engine ({runtime.describe()})", storage=storage,
                           batch_tokens=batch_tokens, prefetch=prefetch, kept=kept)


def open_states(online: OnlineOptions | None, data_dir: Path, info: TargetInfo, trust_remote_code: bool,
                output: Path, rank: int, world_size: int) -> AbstractContextManager[HiddenStateData]:
    """Where 04's states come from: 02's folder `data_dir`, or (`online`) the target's engine, open for
    the run (`data_dir` is then where `--max-disk` keeps some; `output` holds vLLM's scratch folder)."""
    if online is None:
        return nullcontext(load_hidden_states(data_dir))
    runtime = Runtime.from_args(online.runtime_args)
    runtime.check_target(info)
    if runtime.vllm and not runtime.vllm_url and world_size > 1 and torch.cuda.is_available():
        raise PipelineError(f"--online --engine vllm under torchrun would start {world_size} engines on the same GPUs: "
                            "start one with scripts/serve_hidden_states.py and pass --vllm-url to share it")
    layer_ids = choose_layer_ids(online.layer_ids, info)
    return open_online_states(online.prepared, data_dir, info, runtime, trust_remote_code, layer_ids,
                              STORAGES[online.storage], online.batch_tokens, online.prefetch, online.max_disk,
                              online.max_samples, output, rank, world_size, online.gpu_memory_utilization)
