"""common/train/host_memory.py: with glibc's malloc told to keep freed memory, a process that makes and
frees large tensors step after step reuses their memory instead of faulting in fresh pages for each.
Each side runs in a process of its own (the options last for the process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import resource, sys
import torch
from common.train.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(10):  # a step's pattern: 64 MB tensors (past glibc's largest mmap threshold), a few alive at once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.ones(16 * 2**20)
    b = a * 2
    c = torch.softmax(b, 0)
    del a
    d = c + 1
    del b, c, d
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, sum(faults[4:]))
"""


def faults_after_warm_up(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc options")
def test_freed_tensors_memory_is_reused_instead_of_faulted_in_anew():
    kept, kept_faults = faults_after_warm_up("keep")
    default, default_faults = faults_after_warm_up("default")
    assert (kept, default) == ("True", "None")
    assert default_faults > 6 * 4 * 16_000  # every tensor's 16,384 pages of 4 KB mapped anew
    assert kept_faults < default_faults / 4  # the heap's memory reused (a block now and then is new)
