"""Step 04's curves in the experiment trackers (common/trackers.py): what a person watching a long
run from another machine reads, beside `train_log.jsonl` and `train_report.json`.

- every `--log-every N` optimizer steps: the training loss and the loss, full and conditional
  accuracy of each TTT step (means over the N steps), tokens/s, the gradient norm (before
  clipping), the learning rate of each optimizer group (Muon's and AdamW's), the share of the time
  spent waiting for states computed online, and the peak GPU memory allocated where there is a GPU;
- every validation pass: its loss, accuracies and the simulated acceptance length at each k;
- every epoch: its tokens/s, training seconds and (online) seconds waited for states;
- once: the resolved settings, the target, the draft config and the data's fingerprint.

The x axis counts optimizer steps done: training step s (train_log.jsonl's 0-based `step`) is drawn
at s + 1, a validation pass after N steps at N. A run resumed after N steps purges what a killed run
wrote past N and draws on from N + 1: one curve, no overlap, no gap. Only rank 0 reports; the
gradient norm and memory are read on report steps alone (the norm's `.item()` waits for the GPU).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from common.draft.validation import per_step, simulated_acceptance_length
from common.trackers import TENSORBOARD_DIR, Trackers, reporting
from common.train.checkpoints import ResumePoint, read_tracker_state
from common.train.optimizers import group_learning_rates
from common.train.settings import TrainSettings

STAGE = "train"  # the trackers' stage name: RUN/tensorboard/train/
TENSORBOARD_TRAIN = f"{TENSORBOARD_DIR}/{STAGE}"


def step_extras(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, sampler: Any,
                device: torch.device | int) -> dict[str, Any]:
    """What a report step adds to the step's metric record (04's trainer, rank 0's values)."""
    extras: dict[str, Any] = {"grad_norm": float(grad_norm), "lrs": group_learning_rates(optimizer)}
    wait = getattr(sampler, "wait_seconds", None)  # online sources: waited so far in this pass
    if wait is not None:
        extras["state_wait_seconds"] = wait
    if torch.cuda.is_available() and torch.device(device).type == "cuda":
        extras["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return extras


class TrainTracking:
    """Turns 04's metric records (as `MetricsLog` receives them) into tracker scalars."""

    def __init__(self, trackers: Trackers, log_every: int) -> None:
        self.trackers, self.log_every = trackers, log_every
        self.window: list[dict[str, float]] = []
        self.window_tokens = 0
        self.window_start = time.perf_counter()
        self.last_wait = 0.0
        self.steps_done = 0

    def epoch_start(self) -> None:
        self.window, self.window_tokens, self.last_wait = [], 0, 0.0
        self.window_start = time.perf_counter()

    def record(self, step: int, record: dict[str, Any]) -> None:
        if "train" in record:
            self.train(step, record)
        elif "val" in record:
            self.validation(step, record["val"])

    def train(self, step: int, record: dict[str, Any]) -> None:
        self.steps_done = step + 1
        self.window.append(record["train"])
        self.window_tokens += record.get("tokens") or 0
        if self.steps_done % self.log_every:
            return
        seconds = time.perf_counter() - self.window_start
        names = self.window[-1].keys()
        scalars: dict[str, float] = {f"train/{k}": sum(m[k] for m in self.window) / len(self.window) for k in names}
        scalars["train/tokens_per_s"] = self.window_tokens / seconds if seconds > 0 else 0.0
        scalars["train/grad_norm"] = record.get("grad_norm")
        scalars.update({f"train/lr/{group}": lr for group, lr in record.get("lrs", {}).items()})
        if "state_wait_seconds" in record:
            waited = record["state_wait_seconds"] - self.last_wait
            self.last_wait = record["state_wait_seconds"]
            scalars["train/state_wait_share"] = waited / seconds if seconds > 0 else 0.0
        if "gpu_peak_allocated_bytes" in record:
            scalars["train/gpu_peak_allocated_gib"] = record["gpu_peak_allocated_bytes"] / 2**30
        self.trackers.log(scalars, self.steps_done)
        self.window, self.window_tokens, self.window_start = [], 0, time.perf_counter()

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """A validation pass after `step` optimizer steps (the record's step)."""
        values = {k.removesuffix("_epoch"): v for k, v in metrics.items()}
        scalars = {f"val/{k}": v for k, v in values.items()}
        cond = per_step(values, "cond_acc")
        scalars.update({f"val/acceptance_length_k{k}": simulated_acceptance_length(cond[:k])
                        for k in range(1, len(cond) + 1)})
        self.trackers.log(scalars, step)

    def epoch(self, train_seconds: float, tokens: int, wait_seconds: float | None) -> None:
        scalars = {"epoch/train_seconds": train_seconds,
                   "epoch/tokens_per_s": tokens / train_seconds if train_seconds else 0.0,
                   "epoch/state_wait_seconds": wait_seconds}
        self.trackers.log(scalars, self.steps_done)
        self.trackers.flush()

    def summary(self, skipped: int, online: dict[str, Any] | None) -> None:
        """The run's counts at its end: samples skipped, and (online) the states computed and kept."""
        scalars: dict[str, Any] = {"run/skipped_samples": skipped}
        for key in ("computed_samples", "compute_seconds", "kept_samples", "kept_bytes"):
            scalars[f"online/{key}"] = (online or {}).get(key)
        self.trackers.log(scalars, self.steps_done)


@contextmanager
def train_tracking(args: argparse.Namespace, settings: TrainSettings, output: Any, resume: ResumePoint | None,
                   enabled: bool, say: Callable[..., None], params: dict[str, Any]) -> Iterator[TrainTracking]:
    """04's trackers (`--report-to`, `--project`, `--run-name`; rank 0 alone: `enabled`), open for the
    training with the run's hyper-parameters logged once. A resumed run continues the checkpoint's
    runs (its W&B id) and draws on from the step after the checkpoint's."""
    position = resume.position if resume is not None else None
    start = position.global_step + 1 if position is not None else None
    with reporting(args, output, STAGE, enabled=enabled, say=say, resume_state=read_tracker_state(resume),
                   start_step=start, report_to=settings.report_to) as trackers:
        trackers.log_params(params)
        tracking = TrainTracking(trackers, settings.log_every)
        tracking.steps_done = position.global_step if position is not None else 0
        yield tracking
