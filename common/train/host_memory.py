"""How 04 takes host memory when it trains on a CPU: the memory a step frees is kept for the next.

    from common.train.host_memory import keep_freed_memory
    keep_freed_memory()  # 04, once its device is known to be the CPU

On a CPU, 04's step makes some thirty short-lived [tokens x draft vocabulary] fp32 tensors (the
logits of each TTT step, their log-softmax, the verifier's softmax, their products and gradients:
2,048 x 32,000 x 4 bytes = 262 MB each at `configs/draft_smollm2.json`'s shape). PyTorch's CPU
allocator takes every buffer from malloc, and glibc's malloc serves any block over its mmap threshold
(32 MB at most) with a fresh mapping and unmaps it when it is freed: each such tensor faults in 64,000
new pages that the kernel zeroes first. At that shape a training step spent 2 s of its 15-19 s in the
kernel (6.2 million page faults in five steps; a softmax over [2048 x 32000] takes 150 ms into a new
tensor, 40 ms into memory already mapped).

`keep_freed_memory` sets two of glibc's malloc options (`mallopt`): no block from mmap
(`M_MMAP_MAX` 0: every block from the heap, where a freed block is reused) and no heap returned to the
kernel unless 2 GiB lie free at its top (`M_TRIM_THRESHOLD`). After the first step the next ones reuse
the same memory: 1.2 million faults instead of 6.2 million over five steps, the kernel's share from 2 s
to 0.5 s a step, and the process's peak resident memory 4.8 GB instead of 3.6 GB (the heap's free
blocks are kept). Nothing computed changes. Transparent huge pages (PyTorch's
`THP_MEM_ALLOC_ENABLE=1`) cut the faults too but not the cost: the kernel then zeroes and maps 2 MB
pages at every allocation, and the step was slower, not faster.

Only where the C library is glibc (Linux); elsewhere nothing is set. 04 calls it when it trains on
the CPU only: on a GPU the host's buffers are a few per step and the trade is not worth their memory.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # bytes free at the heap's top before it is trimmed (mallopt takes an int)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory freed tensors leave, for the next ones (module docstring).
    Returns whether both options were set (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
