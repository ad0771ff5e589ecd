"""The read side of step 02's hidden-state folder, for 04 (training) and 05 (held-out figures):
checked, split and loaded through speculators 0.3.0's own data path.

`split_files`'s seeded shuffle (train/validation), `Eagle3SampleFileDataset` with `standardize_data_v1`
(step 02's files unchanged; fp8 files are dequantized first, see common/hidden_states/storage.py),
`AddUniformNoise` on the training auxiliary states, `MultipackDistributedBatchSamplerV2` packing
samples into sequences of `total_seq_len` tokens per rank, `create_collate_fn`. Four adjustments,
each explained where made: the split shuffles prepared rows, not the folder's listing order; the
sampler gets the exact lengths of `sample_lengths.json` instead of the library's file-size
estimate; the folder is checked first for anything the dataset would misread; and a file that
cannot be loaded or does not match the manifests is skipped and counted instead of ending the run
(common/hidden_states/skip_damaged.py). The sampler is subclassed only to start a pass after the
batches a step checkpoint already trained.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from speculators.train.data import create_collate_fn, list_files
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators.train.noise_transforms import AddUniformNoise
from torch.utils.data import DataLoader

from common.atomic import read_json
from common.draft.model import DraftShape
from common.errors import PipelineError, first_line
from common.hidden_states.data_config import DATA_CONFIG, NUM_STATES, SAMPLE_LENGTHS, DataConfig
from common.hidden_states.skip_damaged import (
    CheckedDataLoader,
    CheckedSampleDataset,
    SkipTally,
    checked_collate,
)
from common.hidden_states.state_files import sample_index
from common.hidden_states.storage import StateStorage, get_storage, standardize_fn
from common.target.config import TargetInfo

SPLIT_FILE = "validation_split.json"  # in the draft folder: which prepared rows 05 may treat as held out


class LoaderSettings(Protocol):
    """What the data path reads of a run's settings (04's `TrainSettings`, 05's `HeldOutLoading`)."""

    total_seq_len: int  # tokens packed per sequence and rank
    seed: int  # the packing order
    noise_std: float  # uniform noise on the training auxiliary states (0: none)
    num_workers: int  # data-loader worker processes


class SplitSettings(Protocol):
    """What the held-out split and its record read of 04's settings."""

    val_ratio: float
    split_seed: int
    seed: int
    total_seq_len: int


@dataclass
class HiddenStateData:
    folder: Path
    config: DataConfig
    lengths: dict[Path, int]  # tokens of every file the library's dataset will load
    unreadable: dict[Path, str] = field(default_factory=dict)  # files found damaged before loading: why

    @property
    def files(self) -> list[Path]:
        return list(self.lengths)

    def dataset(self, files: list[Path], max_len: int, transform: Callable | None) -> CheckedSampleDataset:
        """The library's file dataset over `files`, with 02's exact lengths (the library would
        estimate them from file sizes) and damaged files skipped (skip_damaged.py)."""
        return CheckedSampleDataset(files, [self.lengths[Path(f)] for f in files], self.config.hidden_size, max_len,
                                    transform, standardize_fn(self.config.storage))

    def batch_sampler(self, dataset: CheckedSampleDataset, **kwargs: Any) -> ResumableBatchSampler:
        return ResumableBatchSampler(lengths=dataset.approx_lengths, **kwargs)

    def num_workers(self, settings: LoaderSettings) -> int:
        return settings.num_workers

    def skip_tally(self, files: list[Path] | None = None) -> SkipTally:
        """A tally of skipped files among `files` (default: all; common/hidden_states/skip_damaged.py),
        told of those already found damaged."""
        files = self.files if files is None else files
        tally = SkipTally(len(files))
        for path in files:
            if Path(path) in self.unreadable:
                tally.add(path, self.unreadable[Path(path)])
        return tally

    def summary(self) -> dict[str, Any] | None:
        """train_report.json's `online`: None for 02's folder (the online source tells its engine's work)."""
        return None

    def describe(self) -> str | None:
        """A closing line of 04 on where the states came from: none for 02's folder."""
        return None


def load_hidden_states(folder: str | Path) -> HiddenStateData:
    """Step 02's folder, checked for what would make speculators' dataset misread it: every
    file it loads (any name ending in `pt`) must be a listed `data_{i}.pt`, and the first
    readable one must hold the four states of the hidden size `data_config.json` declares. Files
    cut short are noted in `unreadable` (skipped when loaded, see common/hidden_states/skip_damaged.py)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PipelineError(f"hidden states {folder}: no such folder (run 02_extract_hidden_states.py first)")
    config = DataConfig.load(folder)
    files = sorted(list_files(folder))
    if not files:
        raise PipelineError(f"hidden states {folder}: no data_*.pt files (run 02_extract_hidden_states.py first)")
    stray = next((f for f in files if sample_index(f) is None), None)
    if stray is not None:
        raise PipelineError(f"hidden states {folder}: {stray} is not a hidden-state file, and speculators' dataset "
                            "loads every file ending in 'pt'; move it out of the folder")
    if not (folder / SAMPLE_LENGTHS).is_file():
        raise PipelineError(f"hidden states {folder}: no {SAMPLE_LENGTHS} (02 did not finish; run it again)")
    listed = {int(i): n for i, n in read_json(folder / SAMPLE_LENGTHS).items()}
    unlisted = [f for f in files if sample_index(f) not in listed]
    if unlisted:
        raise PipelineError(f"hidden states {folder}: {unlisted[0]} is not listed in {SAMPLE_LENGTHS} "
                            f"({len(unlisted)} such files; run 02_extract_hidden_states.py again to finish the folder)")
    # A file cut short (a killed copy, a full disk) gives itself away by its size without being
    # read: the four states alone take 4 x S x H x 2 bytes (bf16).
    storage = _storage(config, folder)
    per_token = storage.bytes_per_token(NUM_STATES, config.hidden_size)
    unreadable = {f: f"cut short ({f.stat().st_size:,} bytes, its {listed[sample_index(f)]} tokens need at least "
                     f"{listed[sample_index(f)] * per_token:,})"
                  for f in files if f.stat().st_size < listed[sample_index(f)] * per_token}
    _check_first_readable(folder, [f for f in files if f not in unreadable], config.hidden_size, storage, unreadable)
    return HiddenStateData(folder, config, {f: listed[sample_index(f)] for f in files}, unreadable)


def _storage(config: DataConfig, folder: Path) -> StateStorage:
    try:
        return get_storage(config.storage)
    except PipelineError as e:
        raise PipelineError(f"hidden states {folder}: {DATA_CONFIG}: {e}") from e


def _check_first_readable(folder: Path, files: list[Path], hidden_size: int, storage: StateStorage,
                          unreadable: dict[Path, str]) -> None:
    """The first file that loads must hold what `data_config.json` declares (a folder of other
    states is refused); files before it that do not load are added to `unreadable`."""
    for path in files:
        try:
            sample = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
            size = sample["input_ids"].shape[0]
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped the same way
            unreadable[path] = f"cannot be loaded ({first_line(e)})"
            continue
        ok = (isinstance(sample.get("loss_mask"), torch.Tensor) and sample["loss_mask"].shape == (size,)
              and storage.holds(sample, NUM_STATES, (size, hidden_size)))
        if not ok:
            raise PipelineError(f"hidden states {path}: expected {NUM_STATES} {storage.dtype_name} states of hidden "
                                f"size {hidden_size}{' with their scales' if storage.scaled else ''} ({DATA_CONFIG} "
                                f"says storage {storage.name}) and one id and mask per position")
        return
    raise PipelineError(f"hidden states {folder}: no readable data file (run 02_extract_hidden_states.py --verify)")


def check_data_fits(data: HiddenStateData, shape: DraftShape, config_path: Path, info: TargetInfo) -> None:
    """The hidden states against the draft config and the target, naming what differs."""
    cfg = data.config
    if cfg.hidden_size != shape.hidden_size:
        raise PipelineError(f"hidden states {data.folder} have hidden size {cfg.hidden_size} ({DATA_CONFIG}), "
                            f"but draft config {config_path} has hidden_size {shape.hidden_size}")
    theirs = {"architecture": cfg.architecture, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    ours = {"architecture": info.architecture, "hidden_size": info.hidden_size, "vocab_size": info.vocab_size}
    differ = [f"{k} {theirs[k]} there, {ours[k]} here" for k in theirs if theirs[k] != ours[k]]
    if differ:
        raise PipelineError(f"hidden states {data.folder} were extracted from another target ({cfg.target}): "
                            f"{'; '.join(differ)} ({info.path})")
    if len(cfg.layer_ids) != NUM_STATES - 1:
        raise PipelineError(f"hidden states {data.folder}: {DATA_CONFIG} lists layer ids {cfg.layer_ids}, "
                            f"EAGLE-3 needs {NUM_STATES - 1}")


def split_rows(rows: list[int], val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    """The library's split (`split_files`: a seeded shuffle, its first `1 - val_ratio` for training)
    over prepared rows in ascending order. The library shuffles the folder's listing order, which is
    the filesystem's (hash order on ext4, reverse creation order on tmpfs): the same folder on another disk
    would split differently and a resumed run there train on other rows."""
    order = sorted(rows)
    random.Random(seed).shuffle(order)
    cut = int(len(order) * (1 - val_ratio))
    return order[:cut], order[cut:]


def split_data(data: HiddenStateData, settings: SplitSettings) -> tuple[list[Path], list[Path]]:
    """Training and validation files, split by prepared row (`split_rows`, seeded by `--split-seed`)."""
    by_row = {sample_index(f): f for f in data.files}
    train, val = split_rows(list(by_row), settings.val_ratio, settings.split_seed)
    if not train:
        raise PipelineError(f"hidden states {data.folder}: {len(val)} samples leave none for training "
                            f"at --val-ratio {settings.val_ratio}")
    return [by_row[i] for i in train], [by_row[i] for i in val]


def make_loader(data: HiddenStateData, files: list[Path], settings: LoaderSettings, world_size: int, rank: int,
                train: bool, pin_memory: bool, tally: SkipTally | None = None) -> DataLoader:
    """The library's data path over `files`, with damaged files skipped and counted in `tally`
    (common/hidden_states/skip_damaged.py; a fresh one for the data when None)."""
    transform = (AddUniformNoise(std=settings.noise_std, tensors=("hidden_states",))
                 if train and settings.noise_std > 0 else None)
    dataset = data.dataset(files, settings.total_seq_len, transform)
    sampler = data.batch_sampler(dataset, batch_max_length=settings.total_seq_len, num_replicas=world_size, rank=rank,
                                 seed=settings.seed)
    workers = data.num_workers(settings)
    return CheckedDataLoader(dataset, tally if tally is not None else data.skip_tally(files), batch_sampler=sampler,
                             num_workers=workers, pin_memory=pin_memory,
                             collate_fn=checked_collate(create_collate_fn(settings.total_seq_len)),
                             persistent_workers=workers > 0, prefetch_factor=8 if workers else None)


class ResumableBatchSampler(MultipackDistributedBatchSamplerV2):
    """The library's packing sampler, able to start its next pass after the first `skip`
    batches of the epoch (a resumed run continuing mid-epoch), without loading them."""

    skip = 0

    def __iter__(self) -> Iterator:
        batches, self.skip = itertools.islice(super().__iter__(), self.skip, None), 0
        return batches


def split_record(data: HiddenStateData, train: list[Path], val: list[Path], settings: SplitSettings,
                 draft_dir: Path) -> dict:
    """The split as prepared-dataset rows (`data_{i}.pt` holds row i of 02's prepared input).
    Folders are recorded relative to `draft_dir`, where the record is written, so the run
    folder can be moved or copied; 05 matches the data by the prepared fingerprint."""
    return {"prepared": os.path.relpath(data.config.prepared, draft_dir),
            "prepared_fingerprint": data.config.prepared_fingerprint,
            "hidden_states": os.path.relpath(data.folder.resolve(), Path(draft_dir).resolve()),
            "val_ratio": settings.val_ratio, "split_seed": settings.split_seed, "seed": settings.seed,
            "total_seq_len": settings.total_seq_len,  # 05 computes its offline figures at the same packing
            "train_samples": len(train),
            "validation_rows": sorted(sample_index(f) for f in val)}


def epoch_tokens(data: HiddenStateData, files: list[Path], total_seq_len: int) -> int:
    """Tokens one epoch trains on, over all ranks (longer samples are cut to `total_seq_len`)."""
    return sum(min(data.lengths[Path(f)] - 1, total_seq_len) for f in files)
