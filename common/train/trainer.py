"""Training the draft (step 04) through speculators 0.3.0's own data path and Trainer.

Data: `split_files` (train/validation by file), `Eagle3SampleFileDataset` with
`standardize_data_v1` (step 02's files unchanged; fp8 files are dequantized first, see
common/hidden_states/storage.py), `AddUniformNoise` on the training
auxiliary states, `MultipackDistributedBatchSamplerV2` packing samples into sequences of
`total_seq_len` tokens per rank, `create_collate_fn`. Three adjustments, each explained where
made: the sampler gets the exact lengths of `sample_lengths.json` instead of the library's
file-size estimate, the folder is checked first for anything the dataset would misread, and a
file that cannot be loaded or does not match the manifests is skipped and counted instead of
ending the run (common/train/sample_files.py).

Training: the library's `Trainer`, subclassed to write checkpoints a resumed run continues from
exactly (fp32 state, RNG, data position; atomic; step checkpoints; mid-epoch resume: see
common/train/checkpoints.py), to time each epoch and to report at its end. The sampler is subclassed
only to start a pass after the batches a step checkpoint already trained. Its metric records
(the `speculators.metrics` logger) go to a JSON-lines log (`MetricsLog`), one line per training
step and one per validation pass; the plot, the closing summary and `train_report.json` are all
read back from that log, so a resumed run reports on the whole training.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.train.data import (
    create_collate_fn,
    list_files,
    split_files,
)
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators.train.noise_transforms import AddUniformNoise
from speculators.train.trainer import Trainer, TrainerConfig
from speculators.train.utils import apply_fully_sharded
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.utils.data import DataLoader
from tqdm import tqdm

from common.atomic import TMP_PREFIX, atomic_path, read_json, remove_stale_temporaries, write_json
from common.draft import patch
from common.draft.model import (
    DraftConfigFile,
    DraftShape,
    checked_fields,
    config_differences,
    read_saved_config,
    saved_tensor,
)
from common.errors import PipelineError
from common.hidden_states.files import DATA_CONFIG, NUM_STATES, SAMPLE_LENGTHS, DataConfig, sample_index
from common.hidden_states.storage import StateStorage, get_storage, standardize_fn
from common.target.config import TargetInfo
from common.train import checkpoints
from common.train.checkpoints import Position, ResumePoint
from common.train.sample_files import CheckedDataLoader, CheckedSampleDataset, SkipTally, checked_collate, first_line

CHECKPOINTS = "checkpoints"
DRAFT = "draft"
LOG_FILE = "train_log.jsonl"
PLOT_FILE = "train_log.png"
REPORT_FILE = "train_report.json"
RUN_OUTPUTS = (CHECKPOINTS, DRAFT, LOG_FILE, PLOT_FILE, REPORT_FILE)  # what one run of 04 writes into its folder
SPLIT_FILE = "validation_split.json"  # in the draft folder: which prepared rows 05 may treat as held out
SCHEDULERS = ("linear", "cosine", "none")
STAGING = TMP_PREFIX + "checkpoint"  # not an int: the library's checkpointer never takes it for an epoch
METRICS_LOGGER = "speculators.metrics"


# --- settings --------------------------------------------------------------------------------


@dataclass
class TrainSettings:
    """The `training` section of a draft config file, overridden by 04's flags of the same name."""

    epochs: int = 3
    lr: float = 1e-4
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    val_ratio: float = 0.1
    noise_std: float = 0.05  # half-width of the uniform noise added to the auxiliary states; 0: none
    total_seq_len: int = 8192  # tokens packed into one training sequence per rank
    scheduler: str = "linear"
    warmup_steps: int | None = None  # None: 1% of all steps (the library's default)
    num_workers: int = 0
    seed: int = 0
    save_every: int = 0  # optimizer steps between step checkpoints; 0: epoch checkpoints only

    @classmethod
    def resolve(cls, file: DraftConfigFile, flags: dict[str, Any],
                preset: Path | None = None) -> tuple[TrainSettings, list[str]]:
        """(settings, one line per value that overrode the file). Precedence: the config file's
        `training` section, then a run preset (`configs/presets/`), then flags (None = unset)."""
        values = {f.name: f.default for f in fields(cls)}
        values.update(checked_fields(cls, file.training, f"draft config {file.path} [training]"))
        overrides = []
        layers = [(f"preset {preset}", read_preset(preset))] if preset is not None else []
        layers.append(("", {f"--{k.replace('_', '-')}": v for k, v in flags.items()}))
        for source, layer in layers:
            for key, value in layer.items():
                name = key.removeprefix("--").replace("-", "_")
                if value is not None:
                    where = f"{source}: {name}" if source else key
                    overrides.append(f"{where} {value} overrides {values[name]}")
                    values[name] = value
        settings = cls(**values)
        settings.check()
        return settings, overrides

    def check(self) -> None:
        rules = [(f"--epochs {self.epochs}", self.epochs >= 1, "at least 1"),
                 (f"--lr {self.lr}", self.lr > 0, "positive"),
                 (f"--ttt-steps {self.ttt_steps}", self.ttt_steps >= 1, "at least 1"),
                 (f"--ttt-step-loss-decay {self.ttt_step_loss_decay}", self.ttt_step_loss_decay > 0, "positive"),
                 (f"--val-ratio {self.val_ratio}", 0 <= self.val_ratio < 1, "in [0, 1)"),
                 (f"--noise-std {self.noise_std}", self.noise_std >= 0, "0 or more"),
                 (f"--total-seq-len {self.total_seq_len}", self.total_seq_len >= 2, "at least 2"),
                 (f"--scheduler {self.scheduler}", self.scheduler in SCHEDULERS, f"one of {', '.join(SCHEDULERS)}"),
                 # the library reads 0 as unset (`warmup or default`), so 0 cannot be honoured
                 (f"--warmup-steps {self.warmup_steps}", self.warmup_steps is None or self.warmup_steps >= 1,
                  "at least 1 (leave it unset for 1% of all steps)"),
                 (f"--num-workers {self.num_workers}", self.num_workers >= 0, "0 or more"),
                 (f"--save-every {self.save_every}", self.save_every >= 0, "0 (off) or more")]
        for flag, ok, rule in rules:
            if not ok:
                raise PipelineError(f"{flag}: must be {rule}")

    def call_kwargs(self) -> dict[str, Any]:
        return {"ttt_steps": self.ttt_steps, "ttt_step_loss_decay": self.ttt_step_loss_decay}


def read_preset(path: Path) -> dict[str, Any]:
    """The `training` section of a run preset (configs/presets/*.json), checked like a config's."""
    if not Path(path).is_file():
        raise PipelineError(f"preset {path}: no such file")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PipelineError(f"preset {path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("training"), dict) or set(data) - {"comment", "training"}:
        raise PipelineError(f"preset {path}: expected an object with a 'training' section (and an optional 'comment')")
    return checked_fields(TrainSettings, data["training"], f"preset {path} [training]")


# --- the hidden-state folder -----------------------------------------------------------------


@dataclass
class HiddenStateData:
    folder: Path
    config: DataConfig
    lengths: dict[Path, int]  # tokens of every file the library's dataset will load
    unreadable: dict[Path, str] = field(default_factory=dict)  # files found damaged before loading: why

    @property
    def files(self) -> list[Path]:
        return list(self.lengths)

    def skip_tally(self, files: list[Path] | None = None) -> SkipTally:
        """A tally of skipped files among `files` (default: all; common/train/sample_files.py),
        told of those already found damaged."""
        files = self.files if files is None else files
        tally = SkipTally(len(files))
        for path in files:
            if Path(path) in self.unreadable:
                tally.add(path, self.unreadable[Path(path)])
        return tally


def load_hidden_states(folder: str | Path) -> HiddenStateData:
    """Step 02's folder, checked for what would make speculators' dataset misread it: every
    file it loads (any name ending in `pt`) must be a listed `data_{i}.pt`, and the first
    readable one must hold the four states of the hidden size `data_config.json` declares. Files
    cut short are noted in `unreadable` (skipped when loaded, see common/train/sample_files.py)."""
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


def split_data(data: HiddenStateData, val_ratio: float, seed: int) -> tuple[list[Path], list[Path]]:
    """The library's `split_files` (a seeded shuffle of the folder's files)."""
    train, val = split_files(str(data.folder), ratio=1 - val_ratio, seed=seed)
    if not train:
        raise PipelineError(f"hidden states {data.folder}: {len(val)} samples leave none for training "
                            f"at --val-ratio {val_ratio}")
    return train, val


def make_loader(data: HiddenStateData, files: list[Path], settings: TrainSettings, world_size: int, rank: int,
                train: bool, pin_memory: bool, tally: SkipTally | None = None) -> DataLoader:
    """The library's data path over `files`, with damaged files skipped and counted in `tally`
    (common/train/sample_files.py; a fresh one for the data when None)."""
    transform = (AddUniformNoise(std=settings.noise_std, tensors=("hidden_states",))
                 if train and settings.noise_std > 0 else None)
    # 02 recorded the exact lengths; the library would estimate them from file sizes.
    dataset = CheckedSampleDataset(files, [data.lengths[Path(f)] for f in files], data.config.hidden_size,
                                   settings.total_seq_len, transform, standardize_fn(data.config.storage))
    sampler = ResumableBatchSampler(batch_max_length=settings.total_seq_len, lengths=dataset.approx_lengths,
                                    num_replicas=world_size, rank=rank, seed=settings.seed)
    workers = settings.num_workers
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


def split_record(data: HiddenStateData, train: list[Path], val: list[Path], settings: TrainSettings,
                 draft_dir: Path) -> dict:
    """The split as prepared-dataset rows (`data_{i}.pt` holds row i of 02's prepared input).
    Folders are recorded relative to `draft_dir`, where the record is written, so the run
    folder can be moved or copied; 05 matches the data by the prepared fingerprint."""
    return {"prepared": os.path.relpath(data.config.prepared, draft_dir),
            "prepared_fingerprint": data.config.prepared_fingerprint,
            "hidden_states": os.path.relpath(data.folder.resolve(), Path(draft_dir).resolve()),
            "val_ratio": settings.val_ratio, "seed": settings.seed, "train_samples": len(train),
            "validation_rows": sorted(sample_index(f) for f in val)}


def epoch_tokens(data: HiddenStateData, files: list[Path], total_seq_len: int) -> int:
    """Tokens one epoch trains on, over all ranks (longer samples are cut to `total_seq_len`)."""
    return sum(min(data.lengths[Path(f)] - 1, total_seq_len) for f in files)


# --- checkpoints ------------------------------------------------------------------------------


def checkpoint_epochs(folder: Path) -> list[int]:
    """Epochs with a checkpoint, in the library's naming (`folder/<epoch>/`)."""
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def prepare_checkpoints(folder: Path, resume: bool, config: Eagle3SpeculatorConfig, d2t: torch.Tensor,
                        is_main: bool) -> ResumePoint | None:
    """The checkpoint to continue from (None: start at epoch 1). With `resume`, it must be
    readable and come from the same draft config and vocabulary. Without it, an earlier run's
    outputs in `folder.parent` are moved aside together, never deleted (`move_earlier_run_aside`)."""
    if is_main and folder.is_dir():
        remove_stale_temporaries(folder)
    if not resume:
        if is_main:
            move_earlier_run_aside(folder.parent)
        return None
    point = checkpoints.latest(folder)
    if point is None:
        if is_main:
            print(f"--resume: no checkpoint in {folder}; starting at epoch 1")
        return None
    checkpoints.check_readable(point.folder)
    differ = config_differences(read_saved_config(point.folder), config)
    saved_d2t = saved_tensor(point.folder, "d2t")
    if saved_d2t is None or not torch.equal(saved_d2t, d2t):
        differ.append("the vocabulary maps (d2t) differ")
    if differ:
        raise PipelineError(f"checkpoint {point.folder} was trained with another draft config: "
                            f"{'; '.join(differ)}; resume with the same config and vocabulary, "
                            "or drop --resume to start over")
    return point


def move_earlier_run_aside(output: Path) -> Path | None:
    """Move the files of an earlier 04 run in `output` (checkpoints, draft, log, plot, report)
    together into `output/train.previous-<time>/`, so a fresh run neither overwrites nor mixes
    with them (the library would overwrite checkpoints epoch by epoch and leave later ones to be
    taken for this run's). Returns the folder, or None when there was nothing to move."""
    found = [output / name for name in RUN_OUTPUTS if (output / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = output / f"train.previous-{stamp}"
    n = 1
    while kept.exists():  # two fresh runs within one second
        n += 1
        kept = output / f"train.previous-{stamp}-{n}"
    kept.mkdir()
    for path in found:
        path.rename(kept / path.name)
    print(f"starting over: the outputs of an earlier run ({', '.join(p.name for p in found)}) were moved to {kept} "
          "(pass --resume to continue a run instead; delete that folder when it is no longer needed)")
    return kept


class ProjectTrainer(Trainer):
    """speculators' Trainer with checkpoints from which a resumed run continues exactly as an
    uninterrupted one would (fp32 state, RNG, data position: see common/train/checkpoints.py), each
    written atomically; a step checkpoint every `save_every` optimizer steps; a resume in the
    middle of an epoch; and each epoch's start and end (after its checkpoint) reported to
    `progress` (rank 0 only)."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, train_loader: DataLoader,
                 val_loader: DataLoader | None, progress: MetricsLog | None, resume: ResumePoint | None = None,
                 save_every: int = 0, settings: dict | None = None) -> None:
        """`settings`: the training settings, recorded in each checkpoint (a resume compares them)."""
        self.settings = settings
        self.resume = resume  # read by setup_trainer, which the library's constructor calls
        self.rank = dist.get_rank() if config.is_distributed else 0
        # The library's own resume knows only epoch checkpoints: it is turned off and the resume
        # point is loaded below, through the library's checkpointer all the same.
        super().__init__(model, config._replace(resume_from_checkpoint=False), train_loader, val_loader)
        if resume is not None:
            self.load_resume_point(resume)
        self.progress = progress
        self.save_every = save_every
        self.train_seconds = 0.0

    def setup_trainer(self) -> None:
        """The epoch and step to start at (the library's version looks at epoch folders only)."""
        point = self.resume
        self.current_epoch = point.epoch if point is not None else 0
        if point is not None and point.position is not None:
            self.global_step = point.position.global_step
        else:  # an epoch checkpoint of an earlier version: whole epochs were trained
            self.global_step = self.current_epoch * len(self.train_loader)

    def setup_model(self) -> None:
        """Single process: the library's. Under torchrun the library shards the draft (moving its
        layers to the meta device), then re-creates the layers on the hard-coded "cuda" and calls
        `reset_parameters` where a module has one, so the layers start from other weights than
        the draft built (and the RMS norms, which have no such method, from uninitialised
        memory). Here the layers are re-created on this rank's device and the draft's own initial
        weights loaded back from rank 0: a torchrun run starts where a single-process one does."""
        if not self.is_distributed:
            super().setup_model()
            return
        initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        apply_fully_sharded(self.model)
        for layer in self.model.layers:
            layer.to_empty(device=self.local_rank)
        set_model_state_dict(self.model, initial, options=StateDictOptions(full_state_dict=True,
                                                                            broadcast_from_rank0=True, strict=False))

    def load_resume_point(self, point: ResumePoint) -> None:
        """Weights, optimizer and scheduler of `point`, read by the library's checkpointer class
        (single-process or FSDP) pointed at that folder. The RNG is restored where the epoch's
        batches start (`epoch_batches`)."""
        reader = type(self.checkpointer)(point.folder.parent)
        reader.previous_epoch = int(point.folder.name)  # the library's name for "the folder to load"
        reader.load_model_state_dict(self.model)
        reader.load_optimizer_state_dict(self.model, self.opt)
        if self.scheduler is not None:
            reader.load_scheduler_state_dict(self.scheduler)

    def train_epoch(self, epoch: int) -> None:
        """The library's epoch, iterating `EpochBatches` instead of the loader itself."""
        skip = self.resume.skip_batches if self.resume is not None and self.resume.epoch == epoch else 0
        if self.progress is not None:
            self.progress.epoch_start(epoch, skip)
        start = time.perf_counter()
        loader = self.train_loader
        self.train_loader = EpochBatches(self, loader, epoch)
        try:
            super().train_epoch(epoch)
        finally:
            self.train_loader = loader
        self.train_seconds = time.perf_counter() - start

    def epoch_batches(self, loader: DataLoader, epoch: int) -> Iterator[dict]:
        """The epoch's batches, after those a resumed step checkpoint already trained, with a step
        checkpoint every `save_every` steps. The library runs one whole step (forward, backward,
        optimizer, scheduler, metric record, step count) between taking one batch and asking for
        the next, so the state saved when it asks holds finished steps only."""
        point, self.resume = self.resume, None
        skip = point.skip_batches if point is not None and point.epoch == epoch else 0
        loader.batch_sampler.skip = skip
        restore = point is not None and point.position is not None
        if restore and not skip:  # an epoch checkpoint: the RNG as it was when the epoch began
            checkpoints.restore_rng(point.folder, self.rank)
        batches = iter(loader)
        if restore and skip:  # iter() drew the workers' seed; the uninterrupted run had drawn it too
            checkpoints.restore_rng(point.folder, self.rank)
        done, total = skip, len(loader)
        for batch in batches:
            yield batch
            done += 1
            if self.save_every and self.global_step % self.save_every == 0 and done < total:
                self.save_step_checkpoint(epoch, done)

    def save_checkpoint(self, epoch: int) -> None:
        self.save_staged(self.checkpointer.path, self.position(epoch, len(self.train_loader), True))
        if self.progress is not None:
            self.progress.epoch_done(epoch, self.train_seconds)

    def position(self, epoch: int, batches_done: int, epoch_complete: bool) -> Position:
        world_size = dist.get_world_size() if self.is_distributed else 1
        return Position(epoch, batches_done, self.global_step, epoch_complete, len(self.train_loader), world_size)

    def save_step_checkpoint(self, epoch: int, batches_done: int) -> None:
        root = self.checkpointer.path
        self.save_staged(root / checkpoints.STEPS, self.position(epoch, batches_done, False))
        if self.rank == 0:
            checkpoints.prune_steps(root)

    def save_staged(self, root: Path, position: Position) -> None:
        """Write `root/<epoch or step>/`. The library writes a checkpoint file by file; a run killed
        in between would leave one that `--resume` trusts, so it is written under a staging name,
        then renamed into place. The RNG is captured first: the uninterrupted run continues from
        the state saved."""
        name = str(position.epoch if position.epoch_complete else position.global_step)
        staging = root / STAGING
        (staging / name).mkdir(parents=True, exist_ok=True)
        checkpoints.write_state(staging / name, position, self.rank, self.settings)
        saved_path, self.checkpointer.path = self.checkpointer.path, staging
        try:
            self.checkpointer.save_checkpoint(self.model, self.opt, name, float_dtype=torch.float32)
            if self.scheduler is not None:
                self.checkpointer.save_scheduler_state_dict(self.scheduler, name)
        finally:
            self.checkpointer.path = saved_path
        if self.is_distributed:
            dist.barrier()  # every rank has written its part of the staging folder
        if self.rank == 0:
            final = root / name
            if final.exists():
                shutil.rmtree(final)
            (staging / name).replace(final)
            shutil.rmtree(staging, ignore_errors=True)
        if self.is_distributed:
            dist.barrier()


class EpochBatches:
    """What the library's `train_epoch` iterates in place of the training loader: it reads only
    `batch_sampler` (to set the epoch), iterates, and may take the length; the batches come
    from `ProjectTrainer.epoch_batches`."""

    def __init__(self, trainer: ProjectTrainer, loader: DataLoader, epoch: int) -> None:
        self.trainer, self.loader, self.epoch = trainer, loader, epoch
        self.batch_sampler = loader.batch_sampler

    def __iter__(self) -> Iterator[dict]:
        return self.trainer.epoch_batches(self.loader, self.epoch)

    def __len__(self) -> int:
        return len(self.loader)


def trainer_config(settings: TrainSettings, checkpoints: Path, resume: bool, distributed: bool,
                   device: torch.device) -> TrainerConfig:
    return TrainerConfig(
        lr=settings.lr, num_epochs=settings.epochs, save_path=str(checkpoints), resume_from_checkpoint=resume,
        is_distributed=distributed, local_rank=patch.trainer_device(device),
        train_call_kwargs={**settings.call_kwargs(), "use_off_policy_tokens": False},
        val_call_kwargs=settings.call_kwargs(), scheduler_type=settings.scheduler,
        scheduler_warmup_steps=settings.warmup_steps)


# --- metrics: log, plot, summary ---------------------------------------------------------------


def read_log(path: Path) -> list[dict]:
    """The records of a metrics log; a line torn by a killed run is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog(logging.Handler):
    """Receives the Trainer's metric records: appends each to the JSON-lines log and drives a
    progress bar per epoch. On a resumed run the records of the epochs being redone are dropped
    first, so the log reads as one uninterrupted training."""

    def __init__(self, path: Path, start_epoch: int, epochs: int, steps_per_epoch: int, tokens_per_epoch: int,
                 start_step: int | None = None) -> None:
        """`start_step`: the global step a mid-epoch resume continues at (steps of `start_epoch`
        before it are kept)."""
        super().__init__(logging.INFO)
        self.path = path
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.tokens_per_epoch = tokens_per_epoch
        kept = [r for r in read_log(path) if r.get("epoch", 0) < start_epoch
                or (start_step is not None and r.get("epoch") == start_epoch and "train" in r
                    and r["step"] < start_step)]
        self.next_step = max((r["step"] + 1 for r in kept if "train" in r), default=0)
        # the losses of a resumed epoch's steps before the resume, for its closing line
        self.resumed_losses = [r["train"]["loss"] for r in kept if "train" in r and r.get("epoch") == start_epoch]
        with atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self.file = path.open("a", encoding="utf-8")
        self.bar: tqdm | None = None
        self.train_losses: list[float] = []
        self.last_val: dict[str, float] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, Mapping):
            return
        self.file.write(json.dumps({"step": getattr(record, "step", None), **record.msg}) + "\n")
        self.file.flush()
        if "train" in record.msg and self.bar is not None:
            metrics = record.msg["train"]
            self.train_losses.append(metrics["loss"])
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", acc0=f"{metrics.get('full_acc_0', 0):.3f}")
        elif "val" in record.msg:
            self.last_val = strip_epoch_suffix(record.msg["val"])

    def epoch_start(self, epoch: int, done: int = 0) -> None:
        """`done`: steps of the epoch trained before a resume."""
        self.bar = tqdm(total=self.steps_per_epoch, initial=done, desc=f"epoch {epoch + 1}/{self.epochs}", unit="step")
        self.train_losses, self.last_val = (self.resumed_losses if done else []), None

    def epoch_done(self, epoch: int, train_seconds: float) -> None:
        """One fixed-format line per epoch, and a fresh plot."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        line = f"epoch {epoch + 1}/{self.epochs}: train loss {_mean(self.train_losses):.4f}"
        if self.last_val is not None:
            accs = "/".join(f"{v:.3f}" for v in per_step(self.last_val, "full_acc"))
            line += f", val loss {self.last_val['loss']:.4f}, val acc {accs}"
        rate = self.tokens_per_epoch / train_seconds if train_seconds else 0.0
        tqdm.write(f"{line}, {train_seconds:.1f}s, {rate:,.0f} tok/s")
        plot_metrics(read_log(self.path), self.path.with_name(PLOT_FILE))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        super().close()


class metrics_logging:  # noqa: N801 - used as a context manager, like contextlib's helpers
    """Attach a `MetricsLog` to the library's metrics logger for the duration of a block."""

    def __init__(self, handler: MetricsLog | None) -> None:
        self.handler = handler
        self.logger = logging.getLogger(METRICS_LOGGER)

    def __enter__(self) -> MetricsLog | None:
        if self.handler is not None:
            self.logger.setLevel(logging.INFO)  # the library logs metrics at INFO
            self.logger.propagate = False
            self.logger.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc: object) -> None:
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.close()


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def strip_epoch_suffix(metrics: dict[str, float]) -> dict[str, float]:
    return {k.removesuffix("_epoch"): v for k, v in metrics.items()}


def per_step(metrics: dict[str, float], name: str) -> list[float]:
    """[metrics["name_0"], metrics["name_1"], ...] for the TTT steps present."""
    values, k = [], 0
    while f"{name}_{k}" in metrics:
        values.append(metrics[f"{name}_{k}"])
        k += 1
    return values


def simulated_acceptance_length(cond_accs: list[float]) -> float:
    """1 + sum over k of prod_{j<=k} cond_acc_j: the expected tokens per verification step when
    draft token k is accepted only if tokens 0..k-1 were."""
    total, run = 1.0, 1.0
    for acc in cond_accs:
        run *= acc
        total += run
    return total


@dataclass
class ValSummary:
    epoch: int
    loss: float
    full_acc: list[float]
    cond_acc: list[float]
    loss_per_step: list[float]
    acceptance_length: float

    @classmethod
    def from_metrics(cls, metrics: dict[str, float], epoch: int) -> ValSummary:
        cond = per_step(metrics, "cond_acc")
        return cls(epoch=epoch, loss=metrics["loss"], full_acc=per_step(metrics, "full_acc"), cond_acc=cond,
                   loss_per_step=per_step(metrics, "loss"), acceptance_length=simulated_acceptance_length(cond))

    def lines(self) -> list[str]:
        rows = [f"validation after epoch {self.epoch + 1}: loss {self.loss:.4f}",
                "  TTT step   loss      full acc   cond acc"]
        rows += [f"  {k:>8}   {lo:<8.4f}  {fa:<9.3f}  {ca:.3f}"
                 for k, (lo, fa, ca) in enumerate(zip(self.loss_per_step, self.full_acc, self.cond_acc))]
        rows.append(f"simulated acceptance length: {self.acceptance_length:.3f} "
                    "(1 + sum over k of the product of cond acc up to k)")
        return rows


def last_validation(records: list[dict]) -> ValSummary | None:
    vals = [r for r in records if "val" in r]
    return ValSummary.from_metrics(strip_epoch_suffix(vals[-1]["val"]), vals[-1]["epoch"]) if vals else None


def best_validation(records: list[dict], epochs: list[int]) -> ValSummary | None:
    """The validation pass with the highest simulated acceptance length among `epochs` (those with
    a checkpoint), as SpecForge and TorchSpec pick the draft to ship; on a tie the later epoch.
    None without validation passes."""
    vals = [ValSummary.from_metrics(strip_epoch_suffix(r["val"]), r["epoch"]) for r in records if "val" in r]
    vals = [v for v in vals if v.epoch in epochs]
    return max(vals, key=lambda v: (v.acceptance_length, v.epoch)) if vals else None


def plot_metrics(records: list[dict], path: Path) -> None:
    """Loss and per-TTT-step accuracy against the training step: training steps as lines,
    validation passes as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train"]) for r in records if "train" in r]
    val = [(r["step"], strip_epoch_suffix(r["val"])) for r in records if "val" in r]
    if not train:
        return
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [s for s, _ in train]
    ax_loss.plot(steps, [m["loss"] for _, m in train], lw=0.8, label="train")
    ax_loss.plot([s for s, _ in val], [m["loss"] for _, m in val], "o-", label="validation")
    for k in range(len(per_step(train[0][1], "full_acc"))):
        line, = ax_acc.plot(steps, [m[f"full_acc_{k}"] for _, m in train], lw=0.8, label=f"train step {k}")
        ax_acc.plot([s for s, _ in val], [m[f"full_acc_{k}"] for _, m in val], "o", color=line.get_color(),
                    label=f"validation step {k}")
    ax_loss.set(xlabel="training step", ylabel="loss (sum over TTT steps)", title="loss")
    ax_acc.set(xlabel="training step", ylabel="full accuracy", title="accuracy per TTT step", ylim=(0, 1))
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device, settings: TrainSettings,
             epoch: int = 0) -> dict[str, float]:
    """Validation metrics as the Trainer computes them (mean over batches), for any model."""
    model.eval()
    loader.batch_sampler.set_epoch(epoch)
    totals: dict[str, float] = {}
    for batch in loader:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        _tokens, _loss, metrics = model(**batch, **settings.call_kwargs())
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v.item()
    return {k: v / len(loader) for k, v in totals.items()}


@dataclass
class TrainReport:
    """`train_report.json`: what was trained on what, and how well."""

    target: str
    data: str
    vocab: str
    draft_config: str
    settings: dict
    train_samples: int
    val_samples: int
    tokens_per_epoch: int
    epochs_run: list[int]  # epochs trained by this invocation (0-based)
    tokens_per_second: float
    checkpoints: list[str]
    draft: str
    log: str
    plot: str
    validation: dict | None = None  # ValSummary of the last validation pass
    overrides: list[str] = field(default_factory=list)
    exported_checkpoint: str | None = None  # the checkpoint the draft folder was exported from
    exported_because: str = ""  # "best validation simulated acceptance length", or why the last one
    best_validation: dict | None = None  # ValSummary of the exported checkpoint's validation pass
    skipped_files: dict[str, str] = field(default_factory=dict)  # hidden-state files not used: why

    def save(self, folder: Path) -> Path:
        write_json(folder / REPORT_FILE, asdict(self))
        return folder / REPORT_FILE
