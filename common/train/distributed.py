"""Starting and ending a `torchrun` job of step 04 on GPUs (NCCL) or on CPUs (gloo).

speculators 0.3.0's `maybe_setup_distributed` calls `torch.accelerator.set_device_index`, which
raises "Cannot access accelerator device when none is available" on a machine without GPUs, so
its distributed path cannot even start on CPU. With an accelerator we call the library's function
unchanged; without one we start the same process group on gloo, the backend torch uses for CPU
tensors. Everything after that (FSDP sharding, the distributed checkpointer, the packing sampler
over ranks) is the library's own path on either backend.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from speculators.train.utils import maybe_setup_distributed


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ  # the library's own test


def setup_distributed() -> tuple[int, int, int, bool]:
    """(local rank, world size, rank, distributed), as the library's `maybe_setup_distributed`."""
    if not under_torchrun() or torch.accelerator.is_available():
        return maybe_setup_distributed()
    dist.init_process_group("gloo")
    return int(os.environ["LOCAL_RANK"]), dist.get_world_size(), dist.get_rank(), True


def teardown_distributed() -> None:
    """End the process group, whichever started it, once every rank is done with it (the barrier:
    no collective of a peer still in flight). The library's `maybe_destroy_distributed` tests a
    flag only its own setup sets, so it would leave the gloo group above running."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_rank(code: int) -> NoReturn:
    """End a torchrun rank whose work is done, with `code`, skipping interpreter finalization.
    Finalization destroys torch's and gloo's C++ objects in no set order and can abort a rank that
    has finished ("terminate called without an active exception", SIGABRT: seen on rank 1 of a
    2-rank CPU run after its last epoch); torchrun then stops the other ranks, rank 0 in the middle
    of exporting the draft. Nothing is left to write here: 04's files are written atomically and
    closed before this, the `with` blocks (the state engine's included) already exited."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
