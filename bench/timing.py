"""Timing shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def median_seconds(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """The median wall-clock seconds of `repeats` calls of `fn`, and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result
