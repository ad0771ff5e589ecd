"""Hidden-state files that cannot be read are skipped, not fatal (steps 04 and 05).

One damaged `data_{i}.pt` among 500K (a disk error, a copy cut short, bytes changed in place)
would stop the library's loader with a traceback in the middle of a week-long run. Here each file
is checked as the library's dataset loads it: it must load, and hold what the folder's manifests
say (`sample_lengths.json`: its length; `data_config.json`: hidden size and storage) with finite
values (one NaN would turn every weight into NaN). A file that fails is replaced by a placeholder
of the same length whose loss mask is all zero: the packing the sampler planned stays as it was,
attention is per sample, and a zero mask adds nothing to the loss (the library divides by the
mask's sum plus 1e-5), so the placeholder trains nothing. Each skipped file is named once on
stderr and counted (`SkipTally`, in 04's and 05's reports); past a share of the files
(`common.errors.skip_limit`, as in step 02) the damage is systematic and
the run stops with one line.

Data-loader workers load in other processes, so a placeholder carries its file and reason in
the batch (`SKIPPED`); `CheckedDataLoader` takes it out in the main process before the Trainer
sees the batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from speculators.train.data import Eagle3SampleFileDataset
from torch.utils.data import DataLoader
from tqdm import tqdm

from common.errors import PipelineError, first_line, skip_limit

SKIPPED = "skipped_file"  # batch key of the placeholders' (path, reason)

__all__ = ["SKIPPED", "SkipTally", "CheckedSampleDataset", "CheckedDataLoader", "checked_collate"]


class SkipTally:
    """The files skipped so far (path -> reason), each named once; a `PipelineError` once they
    exceed the limit for `total` files."""

    def __init__(self, total: int, what: str = "hidden-state files",
                 remedy: str = "02_extract_hidden_states.py --verify redoes them") -> None:
        self.total = total
        self.what = what
        self.remedy = remedy
        self.limit = skip_limit(total)
        self.skipped: dict[str, str] = {}

    def add(self, path: str | Path, reason: str) -> None:
        path = str(path)
        if path in self.skipped:
            return
        self.skipped[path] = reason
        tqdm.write(f"warning: skipped {path}: {reason} ({len(self.skipped)} of {self.total:,} {self.what} skipped "
                   f"so far, limit {self.limit}; {self.remedy})", file=sys.stderr)
        if len(self.skipped) > self.limit:
            raise PipelineError(f"{len(self.skipped)} of {self.total:,} {self.what} could not be used (more than the "
                                f"limit of {self.limit}), the last {path}: {reason} ({self.remedy}). Checkpoints "
                                "written so far are kept")

    def add_batch(self, entries: list[tuple[str, str]]) -> None:
        for path, reason in entries:
            self.add(path, reason)


class CheckedSampleDataset(Eagle3SampleFileDataset):
    """The library's file dataset, with each sample checked against the folder's manifests and
    a placeholder for a file that fails (see the module docstring). `lengths[i]` is file i's
    length from `sample_lengths.json`; it also replaces the library's estimate from file sizes
    (which loads file 0 to calibrate, and is far off when per-file overhead rivals the data)."""

    def __init__(self, files: list[Path], lengths: list[int], hidden_size: int, max_len: int,
                 transform: Callable | None, standardize_fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.lengths = lengths
        self.hidden_size = hidden_size
        super().__init__(max_len=max_len, file_list=[str(f) for f in files], transform=transform,
                         standardize_fn=standardize_fn)

    def _compute_approx_lengths(self) -> list[int]:
        # One less: the dataset drops a position when it shifts inputs and targets.
        return [n - 1 for n in self.lengths]

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            sample = self.load(index)
            problem = self.mismatch(sample, self.lengths[index] - 1)
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, it is skipped the same way
            problem = self.failure(e)
        if problem is None:
            return sample
        return self.placeholder(self.lengths[index] - 1, (self.name(index), problem))

    def name(self, index: int) -> str:
        """How a skipped sample is named (its file)."""
        return str(self.data[index])

    def failure(self, error: Exception) -> str:
        """Why loading a sample failed, for the skip message."""
        return f"cannot be loaded ({first_line(error)})"

    def load(self, index: int) -> dict[str, Any]:
        """Sample `index` as the library loads it (its file, standardized, transformed, shifted)."""
        return super().__getitem__(index)

    def mismatch(self, sample: dict[str, Any], n: int) -> str | None:
        """What in a loaded (and shifted) sample differs from the manifests, or None."""
        h = self.hidden_size
        shapes = {"input_ids": (n,), "loss_mask": (n,), "hidden_states": (n, 3 * h),
                  "verifier_last_hidden_states": (n, h)}
        for key, shape in shapes.items():
            if tuple(sample[key].shape) != shape:
                return (f"{key} has shape {tuple(sample[key].shape)}, expected {shape} from sample_lengths.json "
                        "and data_config.json")
        for key in ("hidden_states", "verifier_last_hidden_states"):
            if not bool(torch.isfinite(sample[key]).all()):
                return f"{key} holds values that are not finite"
        return None

    def placeholder(self, n: int, skipped: tuple[str, str]) -> dict[str, Any]:
        """A shifted sample of n positions that trains nothing (loss mask all zero)."""
        h, dtype = self.hidden_size, self.hidden_states_dtype
        return {"input_ids": torch.zeros(n, dtype=torch.long), "hidden_states": torch.zeros(n, 3 * h, dtype=dtype),
                "verifier_last_hidden_states": torch.zeros(n, h, dtype=dtype),
                "loss_mask": torch.zeros(n, dtype=torch.long), "lengths": torch.tensor([n], dtype=torch.long),
                "position_ids": torch.arange(1, n + 1, dtype=torch.long), SKIPPED: skipped}


def checked_collate(collate: Callable[[list[dict]], dict]) -> Callable[[list[dict]], dict]:
    """The library's collate, with the placeholders' file names set aside under `SKIPPED`."""
    def collate_fn(batch: list[dict]) -> dict:
        skipped = [item.pop(SKIPPED) for item in batch if SKIPPED in item]
        collated = collate(batch)
        collated[SKIPPED] = skipped
        return collated
    return collate_fn


class CheckedDataLoader(DataLoader):
    """A DataLoader whose batches leave out `SKIPPED`, telling `tally` instead (in the main
    process, whichever worker loaded the file)."""

    def __init__(self, dataset: CheckedSampleDataset, tally: SkipTally, **kwargs: Any) -> None:
        self.tally = tally
        super().__init__(dataset, **kwargs)

    def __iter__(self) -> Iterator[dict]:
        # The library's iterator is made here, not on the first batch: making it draws the
        # workers' seed, which a resumed run restores around this very call.
        return self._reported(super().__iter__())

    def _reported(self, batches: Iterator[dict]) -> Iterator[dict]:
        for batch in batches:
            self.tally.add_batch(batch.pop(SKIPPED, []))
            yield batch
