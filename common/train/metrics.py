"""Step 04's metrics: the JSON-lines log of the Trainer's metric records (`MetricsLog`, one
line per training step and one per validation pass), the progress bars and per-epoch lines, the
plot, and the best and last validation passes (common/draft/validation.py's summaries), read back from
the log, so a resumed run reports on the whole training (`train_report.json`: common/train/summary.py).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from tqdm import tqdm

from common.atomic import atomic_path
from common.draft.validation import ValSummary, per_step
from common.train.tracking import TrainTracking

LOG_FILE = "train_log.jsonl"
PLOT_FILE = "train_log.png"
REPORT_FILE = "train_report.json"
METRICS_LOGGER = "speculators.metrics"


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
                 start_step: int | None = None, tracking: TrainTracking | None = None) -> None:
        """`start_step`: the global step a mid-epoch resume continues at (steps of `start_epoch`
        before it are kept); `tracking`: the experiment trackers' view of the same records."""
        super().__init__(logging.INFO)
        self.path = path
        self.tracking = tracking
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
        if self.tracking is not None:
            self.tracking.record(getattr(record, "step", 0), dict(record.msg))
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
        if self.tracking is not None:
            self.tracking.epoch_start()

    def epoch_done(self, epoch: int, train_seconds: float, wait_seconds: float | None = None) -> None:
        """One fixed-format line per epoch, and a fresh plot. `wait_seconds`: the time the trainer
        waited for hidden states computed online (None offline)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        line = f"epoch {epoch + 1}/{self.epochs}: train loss {_mean(self.train_losses):.4f}"
        if self.last_val is not None:
            accs = "/".join(f"{v:.3f}" for v in per_step(self.last_val, "full_acc"))
            line += f", val loss {self.last_val['loss']:.4f}, val acc {accs}"
        rate = self.tokens_per_epoch / train_seconds if train_seconds else 0.0
        waited = (f", waited {wait_seconds:.1f}s for hidden states ({wait_seconds / train_seconds:.0%})"
                  if wait_seconds is not None and train_seconds else "")
        tqdm.write(f"{line}, {train_seconds:.1f}s, {rate:,.0f} tok/s{waited}")
        if self.tracking is not None:
            self.tracking.epoch(train_seconds, self.tokens_per_epoch, wait_seconds)
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


def last_validation(records: list[dict], k: int | None = None) -> ValSummary | None:
    vals = [r for r in records if "val" in r]
    return ValSummary.from_metrics(strip_epoch_suffix(vals[-1]["val"]), vals[-1]["epoch"], k) if vals else None


def best_validation(records: list[dict], epochs: list[int], k: int | None = None) -> ValSummary | None:
    """The validation pass with the highest simulated acceptance length at `k` (the served k;
    default every step validated) among `epochs` (those with a checkpoint), as SpecForge and
    TorchSpec pick the draft to ship; on a tie the later epoch. None without validation passes."""
    vals = [ValSummary.from_metrics(strip_epoch_suffix(r["val"]), r["epoch"], k) for r in records if "val" in r]
    vals = [v for v in vals if v.epoch in epochs]
    return max(vals, key=lambda v: (v.acceptance_length, v.epoch)) if vals else None


def plot_metrics(records: list[dict], path: Path) -> None:
    """Loss and per-TTT-step accuracy against the training step: training steps as lines,
    validation passes as markers."""
    import matplotlib  # heavy (about a second to import): only a run that plots pays for it

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
