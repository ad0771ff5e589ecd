"""Run upstream speculators' own trainer (`python -m speculators.train`, 0.9.0) on CPU or one GPU.

    .venv-speculators/bin/python bench/upstream/train.py [--trainable-lm-head] [--epoch-seconds FILE]
        SPECULATORS_TRAIN_FLAGS...

Run by bench/upstream/adapter.py in upstream's environment (scripts/setup_speculators_env.sh),
never imported by the project: it needs speculators 0.9.0, which cannot share a process with 04's
0.3.0. Its installed files are not edited; with no CUDA device, the few things that assume a GPU are
patched here, in this process only, before its entry point runs (on a GPU it runs on CUDA device 0
as it is):

- the Trainer moves the model and every batch to `get_local_rank()` (CUDA device 0): a CPU device;
- its step timer calls `torch.accelerator.synchronize()`, which fails without an accelerator: a no-op.

The caller passes the rest as flags, on either device: `--draft-attn-impl sdpa` (FlexAttention's
block masks need CUDA), `--loss-implementation eager` (the fused loss is a Triton kernel), `--hidden-states-dtype
float32` (CPU autocast to bf16 is slow and would differ from 04's fp32 training), `--num-workers 0`.

`--trainable-lm-head` (ours, not upstream's) trains the draft lm_head, which upstream freezes at the
target's rows: 0.9.0 has no flag for it, so it is switched on after the draft is built.
`--epoch-seconds FILE` (ours too, for bench/bench_04_train.py) writes the seconds of each
`Trainer.train_epoch` (its training time, validation and checkpoints excluded) to FILE as a JSON list.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

TRAINABLE_LM_HEAD = "--trainable-lm-head"
EPOCH_SECONDS = "--epoch-seconds"


def patch_for_cpu() -> None:
    from speculators.train import trainer

    trainer.get_local_rank = lambda: "cpu"  # Trainer: self.model.to(local_rank), batch.to(local_rank)
    torch.accelerator.synchronize = lambda *_args, **_kwargs: None  # _StepTimer marks; nothing to wait for on CPU


def train_lm_head() -> None:
    """The draft lm_head trained: its `requires_grad` set after upstream builds the draft (the optimizer
    is built from requires_grad parameters)."""
    from speculators.train import cli

    build = cli.build_draft_model

    def build_with_trainable_head(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        model.lm_head.weight.requires_grad_(True)
        return model

    cli.build_draft_model = build_with_trainable_head


def time_epochs(path: Path) -> None:
    """Append each `train_epoch`'s seconds to the JSON list in `path`."""
    from speculators.train.trainer import Trainer

    train_epoch = Trainer.train_epoch
    seconds: list[float] = []

    def timed(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = train_epoch(self, *args, **kwargs)
        seconds.append(time.perf_counter() - start)
        path.write_text(json.dumps(seconds))
        return result

    Trainer.train_epoch = timed


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        patch_for_cpu()
    if TRAINABLE_LM_HEAD in argv:
        train_lm_head()
    if EPOCH_SECONDS in argv:
        i = argv.index(EPOCH_SECONDS)
        time_epochs(Path(argv[i + 1]))
        argv = argv[:i] + argv[i + 2:]
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve([a for a in argv if a != TRAINABLE_LM_HEAD]))


if __name__ == "__main__":
    main(sys.argv[1:])
