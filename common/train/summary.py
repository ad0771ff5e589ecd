"""The close of step 04: the checkpoint exported as the draft (`export_chosen`: the best validation
simulated acceptance length at the served k, the last one without validation), the closing lines and
`train_report.json` (`report_run`, `TrainReport`), all read back from the metrics log and the
checkpoints, so a resumed run reports on the whole training."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from speculators.models.eagle3 import Eagle3SpeculatorConfig

from common.atomic import write_json
from common.draft.model import export_draft
from common.draft.validation import ValSummary
from common.hidden_states.loader import HiddenStateData
from common.hidden_states.skip_damaged import SkipTally
from common.train.checkpoints import numbered
from common.train.metrics import LOG_FILE, PLOT_FILE, REPORT_FILE, best_validation, last_validation, read_log
from common.train.settings import TrainSettings
from common.train.trainer import CHECKPOINTS, DRAFT


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
    skipped_files: dict[str, str] = field(default_factory=dict)  # hidden-state files (online: rows) not used: why
    online: dict | None = None  # --online: engine, prefetch, states computed, seconds spent
    state_wait_seconds: dict[str, float] = field(default_factory=dict)  # --online: epoch (1-based) -> waited for states

    def save(self, folder: Path) -> Path:
        write_json(folder / REPORT_FILE, asdict(self))
        return folder / REPORT_FILE


@dataclass
class Exported:
    """The checkpoint exported as the draft, and why that one."""

    checkpoint: Path
    because: str
    best: ValSummary | None  # its validation pass (None: the last checkpoint, no validation)
    draft: Path  # the exported draft folder
    epochs: list[int]  # the epochs with a checkpoint
    records: list[dict]  # the metrics log


def export_chosen(output: Path, config: Eagle3SpeculatorConfig, served_k: int, notes: dict[str, dict]) -> Exported:
    """Export the best checkpoint of `output` by validation simulated acceptance length at the served
    k (the last without validation) as `output`/draft, `notes` beside it (the validation split)."""
    epochs = numbered(output / CHECKPOINTS)
    records = read_log(output / LOG_FILE)
    best = best_validation(records, epochs, served_k)
    chosen = best.epoch if best else epochs[-1]
    because = (f"best validation simulated acceptance length at k = {served_k}" if best
               else "last checkpoint (no validation pass: --val-ratio 0)")
    checkpoint = output / CHECKPOINTS / str(chosen)
    draft_dir = export_draft(checkpoint, config, output / DRAFT, notes)
    print(f"exported checkpoint {checkpoint} ({because}"
          + (f": {best.acceptance_length:.3f} after epoch {best.epoch + 1})" if best else ")"))
    return Exported(checkpoint, because, best, draft_dir, epochs, records)


def report_run(output: Path, exported: Exported, settings: TrainSettings, *, sources: dict[str, str],
               overrides: list[str], data: HiddenStateData, train_files: list[Path], val_files: list[Path],
               tokens: int, start_epoch: int, train_seconds: float, state_waits: dict[int, float],
               skips: SkipTally) -> Path:
    """The last validation pass, `train_report.json` and the closing lines. `sources`: the report's
    target, data, vocab and draft_config."""
    validation = last_validation(exported.records, settings.served_k)
    for line in validation.lines() if validation else ["no validation pass (--val-ratio 0)"]:
        print(line)
    report = TrainReport(
        **sources, settings=vars(settings), train_samples=len(train_files), val_samples=len(val_files),
        tokens_per_epoch=tokens, epochs_run=list(range(start_epoch, settings.epochs)),
        tokens_per_second=tokens / train_seconds if train_seconds else 0.0,
        checkpoints=[str(output / CHECKPOINTS / str(e)) for e in exported.epochs], draft=str(exported.draft),
        log=str(output / LOG_FILE), plot=str(output / PLOT_FILE),
        validation=vars(validation) if validation else None, overrides=overrides,
        exported_checkpoint=str(exported.checkpoint), exported_because=exported.because,
        best_validation=vars(exported.best) if exported.best else None, skipped_files=skips.skipped,
        online=data.summary(), state_wait_seconds={str(e + 1): w for e, w in state_waits.items()})
    report_path = report.save(output)
    print(f"trained epochs {start_epoch + 1}-{settings.epochs} of {settings.epochs} on {len(train_files):,} samples "
          f"({tokens:,} tokens per epoch, {report.tokens_per_second:,.0f} tok/s in the last epoch)"
          if report.epochs_run else f"nothing to train: all {settings.epochs} epochs have checkpoints")
    if skips.skipped:
        print(f"skipped {len(skips.skipped):,} of {len(data.files):,} {skips.what} that could not be used "
              f"(listed in {report_path}; {skips.remedy})")
    if (line := data.describe()) is not None:
        print(line)
    print(f"outputs: {exported.draft} (draft), {output / CHECKPOINTS} ({len(exported.epochs)} checkpoints), "
          f"{output / LOG_FILE}, {output / PLOT_FILE}, {report_path}")
    return report_path
