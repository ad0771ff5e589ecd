"""Step 04's Trainer set-up: the draft's starting weights, the checkpoints folder, and
speculators 0.3.0's own `Trainer`, subclassed in this one place.

The subclass writes checkpoints a resumed run continues from exactly (fp32 state, RNG, data
position; atomic; step checkpoints; mid-epoch resume: see common/train/checkpoints.py), builds the
optimizer of `--optimizer` (common/train/optimizers.py) where the library builds its AdamW, runs the
draft's forward under bf16 autocast where `--precision` asks for it, feeds the TTT steps the
dataset's tokens or the draft's (`--ttt-inputs`), accumulates the gradients of `--grad-accum`
packed batches into each optimizer step, times each epoch and reports at its end to the metrics log
(common/train/metrics.py). The data path is common/hidden_states/loader.py.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.train.trainer import Trainer, TrainerConfig
from torch.utils.data import DataLoader

from common.atomic import TMP_PREFIX, remove_stale_temporaries
from common.draft import patch
from common.draft.model import config_differences, read_saved_config, saved_tensor
from common.errors import PipelineError
from common.train import checkpoints
from common.train.checkpoints import Position, ResumePoint
from common.train.distributed import shard_draft
from common.train.metrics import LOG_FILE, METRICS_LOGGER, PLOT_FILE, REPORT_FILE, MetricsLog
from common.train.optimizers import build_optimizer, build_scheduler
from common.train.settings import TrainSettings
from common.train.tracking import TENSORBOARD_TRAIN, step_extras

CHECKPOINTS = "checkpoints"
DRAFT = "draft"
# what one run of 04 writes into its folder (its curves in a sub-folder of the run's tensorboard/)
RUN_OUTPUTS = (CHECKPOINTS, DRAFT, LOG_FILE, PLOT_FILE, REPORT_FILE, TENSORBOARD_TRAIN)
METRICS = logging.getLogger(METRICS_LOGGER)  # the library's metrics logger, read by MetricsLog
STAGING = TMP_PREFIX + "checkpoint"  # not an int: the library's checkpointer never takes it for an epoch


@dataclass
class MicroBatch:
    """A packed batch and its place in its accumulation group: the `count` batches (`--grad-accum`,
    fewer for an epoch's last group) whose gradients make one optimizer step."""

    batch: dict
    index: int  # 0-based, within the group
    count: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def group_place(done: int, total: int, size: int) -> tuple[int, int]:
    """(index in its group, the group's size) of batch `done` (0-based) of an epoch of `total`
    batches grouped by `size` from the epoch's start; the last group holds what is left."""
    index = done % size
    return index, min(size, total - (done - index))


def optimizer_steps(batches: int, grad_accum: int) -> int:
    """Optimizer steps of an epoch of `batches` packed batches: one per group of `grad_accum`, and
    one for a shorter last group."""
    return math.ceil(batches / grad_accum)


@dataclass
class Accumulated:
    """The metrics and tokens of an accumulation group's batches so far."""

    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int | None = 0
    count: int = 0

    def add(self, metrics: dict[str, torch.Tensor], batch: dict) -> None:
        for key, value in metrics.items():
            value = value.detach()  # the sum must not hold the batch's graph
            self.metrics[key] = self.metrics[key] + value if key in self.metrics else value
        tokens = int(batch["lengths"].sum()) if "lengths" in batch else None
        self.tokens = None if tokens is None or self.tokens is None else self.tokens + tokens
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """Each metric averaged over the group's batches (a group of one: its tensors unchanged)."""
        if self.count == 1:
            return self.metrics
        return {key: value / self.count for key, value in self.metrics.items()}


def prepare_draft(model: Eagle3DraftModel, settings: TrainSettings) -> None:
    """The draft's starting point, drawn from the generator `settings.seed` seeded. `init
    normal`: the decoder layers' and fc's weights from N(0, initializer_range) (0.02), biases 0,
    norms 1, as transformers' `post_init` gives upstream's drafts; 'torch' keeps PyTorch's
    nn.Linear defaults (speculators 0.3.0 never calls `post_init`). The embedding and both
    lm_heads are the target's either way. `freeze_draft_lm_head`: the draft lm_head stays the
    target's."""
    if settings.init == "normal":
        std = model.config.transformer_layer_config.initializer_range
        for module in [*model.layers.modules(), model.fc]:
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
    if settings.freeze_draft_lm_head:
        model.lm_head.weight.requires_grad = False


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
        moved = kept / path.relative_to(output)
        moved.parent.mkdir(parents=True, exist_ok=True)
        path.rename(moved)
    print(f"starting over: the outputs of an earlier run ({', '.join(p.name for p in found)}) were moved to {kept} "
          "(pass --resume to continue a run instead; delete that folder when it is no longer needed)")
    return kept


class ProjectTrainer(Trainer):
    """speculators' Trainer with checkpoints from which a resumed run continues exactly as an
    uninterrupted one would (fp32 state, RNG, data position: see common/train/checkpoints.py), each
    written atomically; a step checkpoint every `save_every` optimizer steps; a resume in the
    middle of an epoch; gradient accumulation over `grad_accum` packed batches per optimizer step
    (`train_step`); and each epoch's start and end (after its checkpoint) reported to `progress`
    (rank 0 only). Steps, the schedule, `save_every` and `global_step` count optimizer steps."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, settings: TrainSettings,
                 train_loader: DataLoader, val_loader: DataLoader | None, progress: MetricsLog | None,
                 resume: ResumePoint | None = None, tracking: bool = False,
                 tracker_state: dict | None = None) -> None:
        self.resume = resume  # read by setup_trainer, which the library's constructor calls
        self.settings = settings  # read by setup_optimizer, likewise
        self.grad_accum = settings.grad_accum  # read by setup_trainer and setup_optimizer
        self.rank = dist.get_rank() if config.is_distributed else 0
        if resume is not None:
            checkpoints.check_accumulation(resume, self.grad_accum)
        # The library's own resume knows only epoch checkpoints: it is turned off and the resume
        # point is loaded below, through the library's checkpointer all the same.
        super().__init__(model, config._replace(resume_from_checkpoint=False), train_loader, val_loader)
        device = torch.device(config.local_rank)
        autocast(self.model, device.type, settings.autocast_dtype(device))
        if resume is not None:
            self.load_resume_point(resume)
        self.progress = progress
        if progress is not None:  # its bar counts optimizer steps, not the loader's batches
            progress.steps_per_epoch = self.steps_per_epoch
        self.save_every = settings.save_every
        self.accumulated = Accumulated()  # the group being accumulated
        self.track_every = settings.log_every if tracking else 0  # steps between the trackers' extra scalars
        self.tracker_state = tracker_state or {}  # kept in each checkpoint, so --resume continues the same runs
        self.train_seconds = 0.0
        self.wait_seconds: float | None = None  # of the last epoch, when the states are computed online
        self.state_waits: dict[int, float] = {}  # epoch -> wait_seconds

    def setup_trainer(self) -> None:
        """The epoch and step to start at (the library's version looks at epoch folders only)."""
        point = self.resume
        self.current_epoch = point.epoch if point is not None else 0
        if point is not None and point.position is not None:
            self.global_step = point.position.global_step
        else:  # an epoch checkpoint of an earlier version: whole epochs were trained
            self.global_step = self.current_epoch * self.steps_per_epoch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: the loader's batches in groups of `grad_accum`."""
        return optimizer_steps(len(self.train_loader), self.grad_accum)

    def setup_model(self) -> None:
        """Single process: the library's. Under torchrun: `shard_draft` (FSDP2 units of each layer's
        attention and MLP, started from the draft's own initial weights, the frozen target weights kept
        sharded)."""
        if not self.is_distributed:
            super().setup_model()
            return
        shard_draft(self.model, self.local_rank)

    def setup_optimizer(self) -> None:
        """The optimizer of `--optimizer` and the library's schedule (its own `setup_optimizer`
        builds AdamW; resuming is `load_resume_point`'s)."""
        self.opt = build_optimizer(self.model, self.settings)
        self.scheduler = build_scheduler(self.opt, self.settings, self.steps_per_epoch)

    def load_resume_point(self, point: ResumePoint) -> None:
        """Weights, optimizer and scheduler of `point`, read by the library's checkpointer class
        (single-process or FSDP) pointed at that folder. The RNG is restored where the epoch's
        batches start (`epoch_batches`)."""
        reader = type(self.checkpointer)(point.folder.parent)
        reader.previous_epoch = int(point.folder.name)  # the library's name for "the folder to load"
        reader.load_model_state_dict(self.model)
        self.check_same_optimizer(reader.optimizer_path(reader.previous_epoch), point.folder)
        reader.load_optimizer_state_dict(self.model, self.opt)
        if self.scheduler is not None:
            reader.load_scheduler_state_dict(self.scheduler)

    def check_same_optimizer(self, path: Path, folder: Path) -> None:
        """The saved optimizer state must have this run's parameter groups (one for AdamW; Muon's
        and AdamW's for muon, the lm_head in the second unless frozen): torch's own refusal
        names neither the checkpoint nor the flags."""
        saved = [len(g["params"]) for g in torch.load(path, mmap=True, weights_only=True)["param_groups"]]
        ours = [len(g["params"]) for g in self.opt.param_groups]
        if saved != ours:
            s = self.settings
            raise PipelineError(f"checkpoint {folder} was trained with another optimizer set-up (parameter groups of "
                                f"{saved} there, {ours} now with --optimizer {s.optimizer}"
                                f"{' --freeze-draft-lm-head' if s.freeze_draft_lm_head else ''}); resume with the "
                                "recipe flags it was trained with, or drop --resume to start over")

    def train_epoch(self, epoch: int) -> None:
        """The library's training epoch (its `train_epoch`: forward, backward, gradients clipped at
        norm 1, optimizer and scheduler step, the metric record of each step), over `epoch_batches`,
        with `grad_accum` batches per step (`train_step`). Each record also holds the step's tokens
        and, every `log_every` steps where trackers listen (`track_every`), the gradient norm, each
        group's learning rate, the peak memory and the wait for states: read only then, as the
        norm's `.item()` waits for the GPU."""
        skip = self.resume.skip_batches if self.resume is not None and self.resume.epoch == epoch else 0
        if self.progress is not None:
            self.progress.epoch_start(epoch, skip // self.grad_accum)  # a resumed step checkpoint ends a group
        start = time.perf_counter()
        self.model.train()
        sampler = self.train_loader.batch_sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for micro in self.epoch_batches(self.train_loader, epoch):
            self.train_step(micro, epoch)
        self.train_seconds = time.perf_counter() - start
        self.wait_seconds = getattr(sampler, "wait_seconds", None)  # online sources measure it
        if self.wait_seconds is not None:
            self.state_waits[epoch] = self.wait_seconds

    def train_step(self, micro: MicroBatch, epoch: int) -> None:
        """One packed batch: its forward and backward, its loss scaled by 1/count so the group's
        gradients add up to those of the mean of its `count` losses (as FSDP averages the ranks'),
        and after the group's last batch the optimizer step. A group of one is the library's step
        exactly. An epoch whose batches `grad_accum` does not divide ends with a shorter group, its
        losses scaled by 1/(its own count): every step takes the mean over the batches it saw.

        Under FSDP every batch's gradients are reduce-scattered as its backward produces them, unit by
        unit, and FSDP adds each rank's share into the sharded gradient the group's earlier batches left
        (`torch.distributed.fsdp`'s post-backward: a sharded `.grad` is accumulated into): a rank holds
        1/world of the gradient between a group's batches, as it does between steps: accumulation costs
        no more than that share, and memory is what it is for (more tokens per step than one pack fits).
        The price is each unit's reduce-scatter once per batch instead of once per group (autograd
        sums a layer's gradients over the TTT steps before FSDP sees them: one reduce-scatter per unit
        and backward)."""
        batch = micro.batch
        device_batch = {k: v.to(self.local_rank, non_blocking=True) if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()}
        _draft_tokens, loss, metrics = self.model(**device_batch, **self.config.train_call_kwargs)
        if micro.first:
            self.opt.zero_grad()
            self.accumulated = Accumulated()
        (loss / micro.count if micro.count > 1 else loss).backward()
        self.accumulated.add(metrics, batch)
        if micro.last:
            self.optimizer_step(epoch)

    def optimizer_step(self, epoch: int) -> None:
        """Clip, step the optimizer and the schedule, and write the step's metric record: each metric
        the mean over the group's batches (then over ranks), the tokens their sum."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        record = {"epoch": epoch, "lr": self.opt.param_groups[0]["lr"]}
        if self.scheduler is not None:
            self.scheduler.step()
        metrics = self.accumulated.mean()
        # One tensor of every metric: one reduce over ranks and one wait for the device per step (the
        # library reduces each metric and reads it with `.item()`: a dozen collectives and waits)
        values = torch.stack([value.float() for value in metrics.values()])
        if self.is_distributed:
            patch.AVERAGING_DIST.reduce(values, dst=0, op=dist.ReduceOp.AVG)
        record = {"train": dict(zip(metrics, values.tolist(), strict=True)), **record,
                  "tokens": self.accumulated.tokens}
        if self.track_every and (self.global_step + 1) % self.track_every == 0:
            record.update(step_extras(self.opt, grad_norm, self.train_loader.batch_sampler, self.local_rank))
        METRICS.info(record, extra={"step": self.global_step})
        self.global_step += 1

    def epoch_batches(self, loader: DataLoader, epoch: int) -> Iterator[MicroBatch]:
        """The epoch's batches, after those a resumed step checkpoint already trained, each with its
        place in its accumulation group, and a step checkpoint every `save_every` optimizer steps.
        The trainer finishes a batch (and, after a group's last, the whole optimizer step: optimizer,
        scheduler, metric record, step count) before asking for the next, and a checkpoint is
        written only then, after a group's last batch: the state saved holds finished steps only, no
        gradient half accumulated, and its `batches_done` ends a group."""
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
            index, count = group_place(done, total, self.grad_accum)
            yield MicroBatch(batch, index, count)
            done += 1
            step_done = index == count - 1
            if step_done and self.save_every and self.global_step % self.save_every == 0 and done < total:
                self.save_step_checkpoint(epoch, done)

    def save_checkpoint(self, epoch: int) -> None:
        self.save_staged(self.checkpointer.path, self.position(epoch, len(self.train_loader), True))
        if self.progress is not None:
            self.progress.epoch_done(epoch, self.train_seconds, self.wait_seconds)

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
        checkpoints.write_state(staging / name, position, self.rank, vars(self.settings), self.tracker_state)
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


def autocast(model: torch.nn.Module, device_type: str, dtype: torch.dtype | None) -> None:
    """Run `model`'s forward (training and validation) under `torch.autocast(dtype)`: mixed
    precision with fp32 master weights, the library's Trainer calling the model unchanged.
    Backward follows the dtypes autocast chose; the optimizer steps fp32 weights outside it."""
    if dtype is None:
        return
    forward = model.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def trainer_config(settings: TrainSettings, checkpoints: Path, resume: bool, distributed: bool,
                   device: torch.device) -> TrainerConfig:
    return TrainerConfig(
        lr=settings.lr, num_epochs=settings.epochs, save_path=str(checkpoints), resume_from_checkpoint=resume,
        is_distributed=distributed, local_rank=patch.trainer_device(device),
        train_call_kwargs=settings.train_call_kwargs(), val_call_kwargs=settings.call_kwargs(),
        scheduler_type=settings.scheduler, scheduler_warmup_steps=settings.warmup_steps)
