"""Atomic file writes: a file or folder appears under its final name complete, or not at all.

Every stage writes through these helpers, so a run killed at any moment (SIGKILL, Ctrl-C, a
full disk) leaves at most a temporary `.tmp-*` name behind, never a truncated final file that a
resumed run would trust.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from common.errors import PipelineError

TMP_PREFIX = ".tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` onto `final` with ordinary permissions (mkstemp/mkdtemp create private
    0600/0700 entries; the result should be readable like any file the user writes)."""
    os.chmod(tmp, (0o777 if tmp.is_dir() else 0o666) & ~_umask())
    os.replace(tmp, final)


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `final`; rename it onto `final` when the block succeeds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # The ".tmp" suffix keeps a leftover temporary from ending in "pt": speculators' file
    # dataset loads every file whose name ends in "pt".
    fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX + final.name + ".", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _publish(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_json(path: str | Path) -> Any:
    """The parsed file; one that does not parse (cut short by a full disk or a killed copy) is a
    `PipelineError` naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise PipelineError(f"{path}: not valid JSON ({e})") from e


def torch_save(obj: Any, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def write_dir(final: str | Path, fill: Callable[[Path], None]) -> None:
    """Fill a temporary folder with `fill(tmp)`, then swap it in for `final` (an old `final` is
    removed only once the new one is complete)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + final.name + ".", dir=final.parent))
    old = final.with_name(TMP_PREFIX + final.name + ".old")
    try:
        fill(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        _publish(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(folder: str | Path) -> int:
    """Delete `.tmp-*` leftovers of a killed run in `folder` (recursively); return the count."""
    count = 0
    for p in Path(folder).rglob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        count += 1
    return count
