"""Step 04's checkpoints, made so that a resumed run equals an uninterrupted one.

speculators 0.3.0's checkpointer writes `<epoch>/` with the weights and AdamW state in bf16 and
nothing else, and its Trainer resumes at the next epoch. Rounding the fp32 weights and moments
to bf16 changes the training (AdamW's step count, a float tensor, even stops being exact past
256), and a kill late in an epoch loses the whole epoch. Here every checkpoint holds:

    model.safetensors, optimizer_state_dict.pt   the library's files, written in fp32
    scheduler_state_dict.pt                      the library's file
    trainer_state.json                           where the run stood (epoch, batches done, optimizer
                                                 step) and the training settings (`check_same_settings`)
    rng_state_<rank>.pt                          each rank's torch / CUDA / Python / NumPy RNG

Epoch checkpoints stay where the library puts them (`checkpoints/<epoch>/`); step checkpoints
(`--save-every N`) go to `checkpoints/steps/<global step>/`, a folder whose name is not an int,
so the library never takes it for an epoch. The last `KEEP_STEP_CHECKPOINTS` step checkpoints
are kept, every epoch checkpoint is. `latest` finds where to continue: the checkpoint with the
highest global step (an epoch checkpoint wins a tie, its validation pass is done).

With `--grad-accum N` a step is N packed batches: a step checkpoint is written only after a step,
so it never holds gradients half accumulated; its `batches_done` counts batches (a multiple of N),
its `global_step` optimizer steps. A run killed inside a group redoes the group from its first batch.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from common.atomic import read_json, write_json
from common.errors import PipelineError

STEPS = "steps"  # sub-folder of the checkpoints folder holding the step checkpoints
STATE_FILE = "trainer_state.json"
STATE_FORMAT = 2
SPLIT_BY_ROW_FORMAT = 2  # from this format on, the run split its data by prepared row (loader.py's split_rows)
KEEP_STEP_CHECKPOINTS = 2
# Training settings a resumed run may change: each takes effect from the resumed step.
# select_k: which epoch is exported; report_to, log_every: where and how often the curves go
# activation_checkpointing: the same step computed with less memory (the same update within float rounding)
CHANGEABLE_ON_RESUME = ("epochs", "num_workers", "save_every", "select_k", "report_to", "log_every",
                        "activation_checkpointing")
# Settings that checkpoints of earlier versions did not record, at the value those trained with.
UNRECORDED = {"target_temperature": 1.0, "grad_accum": 1, "activation_checkpointing": False}


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pt"


@dataclass
class Position:
    """Where training stood when a checkpoint was written."""

    epoch: int  # the epoch being trained (0-based)
    batches_done: int  # packed batches of that epoch already trained (all of them in an epoch checkpoint;
    #                    a multiple of grad_accum in a step checkpoint: whole accumulation groups)
    global_step: int  # optimizer steps taken since the start of the run (the next step's number)
    epoch_complete: bool  # an epoch checkpoint: training and validation of `epoch` are done
    batches_per_epoch: int = 0  # per rank; with `world_size`, what a mid-epoch position means
    world_size: int = 1


@dataclass
class ResumePoint:
    """A checkpoint to continue from, and what to do first."""

    folder: Path
    position: Position | None  # None: a checkpoint of an earlier version (epoch only, no RNG)

    @property
    def epoch(self) -> int:
        """The epoch to continue in."""
        if self.position is None:
            return int(self.folder.name) + 1
        return self.position.epoch + (1 if self.position.epoch_complete else 0)

    @property
    def skip_batches(self) -> int:
        """Batches of `epoch` already trained."""
        return 0 if self.position is None or self.position.epoch_complete else self.position.batches_done

    def describe(self, epochs: int) -> str:
        if self.skip_batches:
            return (f"step checkpoint {self.folder} (step {self.position.global_step:,}): "
                    f"epoch {self.epoch + 1} of {epochs}, after batch {self.skip_batches:,}")
        return f"checkpoint {self.folder}: epoch {self.epoch + 1} of {epochs}"


def check_resumable(point: ResumePoint, batches_per_epoch: int, world_size: int) -> None:
    """A position inside an epoch counts batches of one packing over one number of ranks: refuse
    to resume it under another (changed --total-seq-len, data or rank count)."""
    position = point.position
    if not point.skip_batches or (position.batches_per_epoch, position.world_size) == (batches_per_epoch, world_size):
        return
    raise PipelineError(f"step checkpoint {point.folder} was taken with {position.batches_per_epoch:,} batches per "
                        f"epoch on {position.world_size} rank(s), this run has {batches_per_epoch:,} on {world_size}; "
                        "resume with the same data, --total-seq-len and rank count, or from the last epoch "
                        "checkpoint (move checkpoints/steps aside)")


def check_accumulation(point: ResumePoint, grad_accum: int) -> None:
    """The epoch's accumulation groups start at its first batch, and a step checkpoint ends one, so
    its batches done are a multiple of `grad_accum`. A position that is not (a checkpoint recording no
    settings, taken without accumulation, resumed with `--grad-accum`) would group the rest of the
    epoch otherwise than any uninterrupted run: refused."""
    if point.skip_batches % grad_accum == 0:
        return
    raise PipelineError(f"step checkpoint {point.folder} was taken after batch {point.skip_batches:,} of its epoch, "
                        f"inside a group of --grad-accum {grad_accum}; resume with the --grad-accum it was trained "
                        "with, or from the last epoch checkpoint (move checkpoints/steps aside)")


def check_readable(folder: Path) -> None:
    """Every file of a checkpoint opens (a file cut short or damaged on disk would stop the
    resumed run with a traceback of the library's loader): safetensors headers and sizes, the
    zip directory of each torch file, the JSON state. One line names the file otherwise."""
    for path in sorted(folder.iterdir()):
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), "pt") as f:
                    f.keys()
            elif path.suffix == ".pt":
                torch.load(path, mmap=True, weights_only=False, map_location="cpu")  # RNG states are not tensors
            elif path.suffix == ".json":
                read_json(path)
        except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
            detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise PipelineError(f"checkpoint {folder}: {path.name} cannot be read ({type(e).__name__}: {detail}); "
                                "move that folder aside to resume from the checkpoint before it, or drop --resume "
                                "to start over") from e


def write_state(folder: Path, position: Position, rank: int, settings: dict | None = None,
                trackers: dict | None = None) -> None:
    """This rank's RNG state, and (rank 0) the position, the training settings and what the
    experiment trackers need to continue the same runs (a W&B run id), into a checkpoint folder
    being written."""
    torch.save(capture_rng(), folder / rng_file(rank))
    if rank == 0:
        write_json(folder / STATE_FILE, {"format": STATE_FORMAT, **asdict(position), "settings": settings,
                                         "trackers": trackers or {}})


def read_tracker_state(point: ResumePoint | None) -> dict:
    """The trackers' state a checkpoint kept (`write_state`); empty for a fresh run or an older checkpoint."""
    path = point.folder / STATE_FILE if point is not None else None
    return read_json(path).get("trackers") or {} if path is not None and path.is_file() else {}


def split_warning(point: ResumePoint) -> str | None:
    """A warning for a checkpoint written before the split by prepared row (state format 1, or an
    earlier version's without a state): its validation rows followed the folder's listing order, so
    the resumed run may hold out other rows. None for a checkpoint of this version."""
    path = point.folder / STATE_FILE
    if path.is_file() and read_json(path).get("format", 1) >= SPLIT_BY_ROW_FORMAT:
        return None
    return (f"warning: checkpoint {point.folder} was written before 04 split the data by prepared row: the rows "
            "it held out for validation may differ from this run's (05 measures the exported draft's own split)")


def read_position(folder: Path) -> Position | None:
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    data = read_json(path)
    data.pop("format", None)
    data.pop("settings", None)
    data.pop("trackers", None)
    return Position(**data)


def check_same_settings(point: ResumePoint, settings: dict) -> None:
    """A resumed run continues the checkpoint's training: a value that would change it from the
    resumed step on in a way no uninterrupted run does (learning rate, schedule, noise, packing,
    split, seed, TTT, the target's temperature) is refused, naming the flag and the checkpoint's
    value. More epochs, other workers or another checkpoint interval take effect from the resumed
    step. Checkpoints of earlier versions recorded no settings: nothing to compare; a setting
    added since is compared with the value they trained with (`UNRECORDED`)."""
    path = point.folder / STATE_FILE
    saved = read_json(path).get("settings") if path.is_file() else None
    for key, value in settings.items():
        trained = None if saved is None else saved.get(key, UNRECORDED.get(key))
        if trained is None or key in CHANGEABLE_ON_RESUME or trained == value:
            continue
        raise PipelineError(f"--{key.replace('_', '-')} {value}: checkpoint {point.folder} was trained with "
                            f"{key} {trained}, which a resumed run keeps; resume with {key} {trained} "
                            "(drop the flag), or start over without --resume")


def capture_rng() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng(folder: Path, rank: int) -> bool:
    """Put this rank's generators back as the checkpoint recorded them; False if it has none."""
    path = folder / rng_file(rank)
    if not path.is_file():
        return False
    state = torch.load(path, weights_only=False)  # Python's and NumPy's states are tuples, not tensors
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


def numbered(folder: Path) -> list[int]:
    """The int-named sub-folders of `folder`, ascending (epochs, or global steps under `steps/`)."""
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def step_folder(root: Path, global_step: int) -> Path:
    return root / STEPS / str(global_step)


def latest(root: Path) -> ResumePoint | None:
    """The checkpoint a resumed run continues from: the last epoch checkpoint, unless a step
    checkpoint of a later step exists."""
    candidates: list[tuple[int, int, ResumePoint]] = []
    epochs = numbered(root)
    if epochs:
        folder = root / str(epochs[-1])
        position = read_position(folder)
        step = position.global_step if position else -1
        candidates.append((step, 1, ResumePoint(folder, position)))
    steps = numbered(root / STEPS)
    if steps:
        folder = step_folder(root, steps[-1])
        position = read_position(folder)
        if position is not None:
            candidates.append((position.global_step, 0, ResumePoint(folder, position)))
    return max(candidates, key=lambda c: c[:2])[2] if candidates else None


def last_checkpoint_note(root: Path) -> str:
    """Where a run that failed can continue: the checkpoint `--resume` would take, if any."""
    point = latest(root)
    if point is None:
        return f"no checkpoint was written to {root} yet; run again to start over"
    return f"the last checkpoint kept is {point.folder}; run again with --resume to continue from it"


def prune_steps(root: Path, keep: int = KEEP_STEP_CHECKPOINTS) -> None:
    """Delete all but the last `keep` step checkpoints."""
    for step in numbered(root / STEPS)[:-keep]:
        shutil.rmtree(step_folder(root, step), ignore_errors=True)
