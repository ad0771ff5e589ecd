"""common/train/distributed.py: a plain process is not distributed; under torchrun's environment
on a machine without GPUs the process group starts on gloo (04's two-rank run is in
tests/test_04_train.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from common.train.distributed import setup_distributed, teardown_distributed, under_torchrun


def test_outside_torchrun_nothing_starts(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not under_torchrun()
    assert setup_distributed() == (0, 1, 0, False)
    assert not dist.is_initialized()
    teardown_distributed()  # nothing to end: no error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_on_cpu_the_group_starts_on_gloo(monkeypatch):
    """What torchrun sets for rank 0 of a one-rank job."""
    assert not torch.accelerator.is_available()  # the CPU path this test is about
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    assert under_torchrun()
    try:
        assert setup_distributed() == (0, 1, 0, True)
        assert dist.get_backend() == "gloo"
    finally:
        teardown_distributed()
    assert not dist.is_initialized()


def test_a_rank_leaves_with_its_code_its_output_flushed_and_no_finalization():
    """leave_rank: the exit code kept, buffered output written, atexit (finalization) not run."""
    code = ("import atexit, sys; from common.train.distributed import leave_rank; "
            "atexit.register(lambda: print('finalized')); print('done', end=''); "
            "print('to stderr', file=sys.stderr, end=''); leave_rank(3)")
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (left.returncode, left.stdout) == (3, "done") and left.stderr.endswith("to stderr")
