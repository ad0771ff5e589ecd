"""Experiment trackers: the curves of a long stage, watched from another machine.

`--report-to` (00, 02, 04 and 05) names one or more of TensorBoard, Weights & Biases and trackio;
each is driven through its own library (`torch.utils.tensorboard.SummaryWriter`, `wandb`,
`trackio`), behind one small interface the stages call (`Trackers`): `log_params` once, `log`
scalars at a step, `close`. Without the flag a stage reports to TensorBoard when the package is
installed (it is in requirements.txt), else to none, and says which in one line.

Where they write: TensorBoard into `RUN/tensorboard/<stage>/` (`tensorboard --logdir runs/` shows
every run folder's stages side by side); W&B into `RUN/wandb/` (offline with `WANDB_MODE=offline`,
synced later with `wandb sync`), project `--project` (default `eagle3`), run name
`--run-name` (default `<run folder>-<stage>`); trackio into its own local database under the same
project and name.

Resume: a stage that continues (04 `--resume`) passes the step it continues at and the state its
checkpoint kept (`state()`): TensorBoard's writer purges the events a killed run wrote past that
step, so the curves count on with no overlap and no gap; W&B continues the same run id; trackio
the same run name.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.errors import PipelineError

TRACKERS = ("tensorboard", "wandb", "trackio")
INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb", "trackio": "pip install trackio"}
DEFAULT_PROJECT = "eagle3"
TENSORBOARD_DIR = "tensorboard"


def add_report_args(parser: argparse.ArgumentParser, report_to: bool = True) -> argparse._ArgumentGroup:
    """The tracker flags, one group. `report_to=False`: the stage has its own --report-to (04's, a
    value of its config file)."""
    group = parser.add_argument_group("experiment tracking")
    if report_to:
        group.add_argument("--report-to", nargs="+", choices=("none", *TRACKERS), default=None, metavar="TRACKER",
                           help="none, or one or more of tensorboard, wandb, trackio (default: tensorboard when the "
                                "package is installed, writing RUN_DIR/tensorboard/STAGE/; else none)")
    group.add_argument("--project", default=DEFAULT_PROJECT,
                       help="W&B / trackio project (default: %(default)s)")
    group.add_argument("--run-name", default=None,
                       help="W&B / trackio run name (default: the run folder's name and the stage)")
    return group


def resolve_report_to(given: list[str] | None, say=print) -> list[str]:
    """The trackers to open: `--report-to` checked (each one's package installed, `none` alone),
    or the default (TensorBoard if installed, said in one line either way)."""
    if given is None:
        if _installed("tensorboard"):
            return ["tensorboard"]
        say(f"reporting to no tracker: tensorboard is not installed ({INSTALL['tensorboard']}; or pass --report-to)")
        return []
    if "none" in given:
        if len(given) > 1:
            raise PipelineError(f"--report-to {' '.join(given)}: 'none' cannot be combined with a tracker")
        return []
    for name in given:
        if not _installed(name):
            raise PipelineError(f"--report-to {name} needs the {name} package, which is not installed: {INSTALL[name]}")
    return list(dict.fromkeys(given))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module blocked or half-installed counts as missing
        return False


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | str | bool]:
    """Nested hyper-parameters as one level of `a/b` keys with scalar values (lists and None as text),
    the form every tracker's hyper-parameter table takes."""
    flat: dict[str, float | int | str | bool] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str) if not isinstance(value, Path) else str(value)
    return flat


class TensorBoardTracker:
    """`SummaryWriter` into `folder`; `purge_step` drops what a killed run wrote from that step on."""

    name = "tensorboard"

    def __init__(self, folder: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only a run that reports pays

        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def log_params(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # The hyper-parameters into this run's own event file (the HPARAMS tab), not the sub-run
        # `add_hparams` would make, and as a readable table in the TEXT tab.
        for summary in hparams(params, {}):
            self.writer.file_writer.add_summary(summary)
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("hyperparameters", "| name | value |\n|---|---|\n" + table, 0)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def state(self) -> dict[str, Any]:
        return {}

    def where(self) -> str:
        return str(self.folder)


class WandbTracker:
    """A W&B run whose files go to `run_dir/wandb/` (W&B names that folder itself); `run_id`
    continues an earlier one (04 --resume)."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str, run_id: str | None) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), id=run_id, resume="allow",
                              reinit="create_new")

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass  # the run's own process writes as it goes

    def close(self) -> None:
        self.run.finish()

    def state(self) -> dict[str, Any]:
        return {"wandb_run_id": self.run.id}

    def where(self) -> str:
        return f"{self.run.dir} (run {self.run.id})"


class TrackioTracker:
    """A trackio run, named so that a resumed stage continues it."""

    name = "trackio"

    def __init__(self, project: str, run_name: str) -> None:
        import trackio

        self.trackio, self.project, self.run_name = trackio, project, run_name
        self.run = trackio.init(project=project, name=run_name, resume="allow")

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.trackio.log(dict(scalars), step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.trackio.finish()

    def state(self) -> dict[str, Any]:
        return {}

    def where(self) -> str:
        return f"trackio project {self.project}, run {self.run_name} (trackio show)"


class Trackers:
    """The trackers a stage reports to (none at all on ranks other than 0), called as one."""

    def __init__(self, trackers: list[TensorBoardTracker | WandbTracker | TrackioTracker]) -> None:
        self.trackers = trackers

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log_params(self, params: Mapping[str, Any]) -> None:
        flat = flat_params(params)
        for tracker in self.trackers:
            tracker.log_params(flat)

    def log(self, scalars: Mapping[str, float | int | None], step: int) -> None:
        """Finite numbers only: a metric that is missing (None) or not a number is left out."""
        clean = {k: float(v) for k, v in scalars.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if clean:
            for tracker in self.trackers:
                tracker.log(clean, step)

    def flush(self) -> None:
        for tracker in self.trackers:
            tracker.flush()

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue the same runs (kept in 04's checkpoints)."""
        return {k: v for tracker in self.trackers for k, v in tracker.state().items()}

    def describe(self) -> str:
        return "; ".join(f"{t.name}: {t.where()}" for t in self.trackers) or "no tracker"

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(report_to: list[str], run_dir: Path, stage: str, project: str = DEFAULT_PROJECT,
                  run_name: str | None = None, resume_state: Mapping[str, Any] | None = None,
                  start_step: int | None = None) -> Trackers:
    """The trackers of `report_to` (already resolved) for `stage` of the run in `run_dir`.
    `start_step`: the first step a resumed stage logs (TensorBoard purges what a killed run wrote from
    there on); `resume_state`: `Trackers.state()` as the checkpoint kept it."""
    run_dir = Path(run_dir)
    name = run_name or f"{run_dir.resolve().name}-{stage}"
    resume_state = resume_state or {}
    opened: list[TensorBoardTracker | WandbTracker | TrackioTracker] = []
    try:
        for tracker in report_to:
            if tracker == "tensorboard":
                opened.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR / stage, start_step))
            elif tracker == "wandb":
                opened.append(WandbTracker(run_dir, project, name, resume_state.get("wandb_run_id")))
            else:
                opened.append(TrackioTracker(project, name))
    except Exception:
        Trackers(opened).close()
        raise
    return Trackers(opened)


@contextmanager
def reporting(args: argparse.Namespace, run_dir: Path, stage: str, enabled: bool = True, say=print,
              resume_state: Mapping[str, Any] | None = None, start_step: int | None = None,
              report_to: list[str] | None = None) -> Iterator[Trackers]:
    """The trackers `args` asks for (`add_report_args`; `report_to` in place of its --report-to where
    the stage resolved the value elsewhere), open for the block and closed after it, even on an
    error; `enabled=False` (ranks other than 0) opens none."""
    if not enabled:
        yield Trackers([])
        return
    wanted = report_to if report_to is not None else getattr(args, "report_to", None)
    trackers = open_trackers(resolve_report_to(wanted, say), run_dir, stage, args.project, args.run_name,
                             resume_state, start_step)
    if trackers:
        say(f"reporting to {trackers.describe()}")
    try:
        yield trackers
    finally:
        trackers.close()
