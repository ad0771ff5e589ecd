"""Atomic file writes: a file or folder appears under its final name complete, or not at all.

Every stage writes through these helpers, so a run killed at any moment (SIGKILL, Ctrl-C, a
full disk) leaves at most a temporary `.tmp-*` name behind, never a truncated final file that a
resumed run would trust. `read_json` and `read_stage_report` read back what they wrote: a file cut
short, or a stage report of another folder format, is a `PipelineError` naming it.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def format_bytes(n: float) -> str:
    """A size with the unit that reads best: 512 B, 3.2 MB, 1.5 TB (powers of 1000)."""
    units, k = ("B", "KB", "MB", "GB", "TB"), 0
    while abs(n) >= 1000 and k < len(units) - 1:
        n, k = n / 1000, k + 1
    return f"{n:,.0f} B" if k == 0 else f"{n:,.1f} {units[k]}"


def write_error(error: OSError, path: str | Path) -> str:
    """What went wrong writing `path`, by cause: a full disk (with the space left on it), a
    file-size limit (`ulimit -f`, or the file system's largest file: not a full disk), a quota;
    any other error as the system words it."""
    path = Path(path)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
        cause = "no space left on its disk" if error.errno == errno.ENOSPC else "disk quota exceeded"
        return f"cannot write {path}: {cause} ({format_bytes(shutil.disk_usage(probe).free)} free); free space or " \
               "choose another output folder, then run the same command again"
    if error.errno == errno.EFBIG:
        return f"cannot write {path}: file too large for the file-size limit of this process (ulimit -f) or of its " \
               "file system; raise the limit or choose another output folder"
    return f"cannot write {path}: {error.strerror or error}"


def failed_write(path: str | Path, detail: str) -> str:
    """`write_error` for a library that words a failed write its own way (torch.save raises
    "file write failed" for a full disk and a file-size limit alike): the likely cause from the
    process's file-size limit and the space left."""
    path = Path(path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (f"cannot write {path} ({detail}); this process may write files of at most {format_bytes(limit)} "
                "(ulimit -f): raise the limit")
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    return f"cannot write {path} ({detail}); {format_bytes(shutil.disk_usage(probe).free)} free on its disk"


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


def read_stage_report(path: str | Path, format_version: int, missing: str | None = None) -> dict:
    """A stage's JSON report (`read_json`) of the folder format `format_version`; another version is a
    `PipelineError` naming both. With `missing`, no file at `path` is a `PipelineError` of that message."""
    path = Path(path)
    if missing is not None and not path.is_file():
        raise PipelineError(missing)
    data = read_json(path)
    if data.get("format_version") != format_version:
        raise PipelineError(f"{path}: format version {data.get('format_version')}, expected {format_version}")
    return data


def torch_save(obj: Any, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        save_whole(obj, tmp)


def save_whole(obj: Any, path: Path) -> int:
    """`torch.save`, then the file's size (returned) checked against the bytes of the tensors in
    `obj`: a write cut short by a file-size limit can leave a truncated file without an error
    from torch (seen with torch 2.13 under `ulimit -f`), which must not be renamed into place."""
    torch.save(obj, path)
    size, needed = path.stat().st_size, _tensor_bytes(obj)
    if size < needed:
        raise RuntimeError(f"torch.save wrote {size:,} bytes, the tensors alone take {needed:,}: "
                           "the write was cut short")
    return size


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct storages of the tensors in `obj` (torch.save writes each once)."""
    storages: dict[int, int] = {}
    pending = [obj]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            pending += item.values()
        elif isinstance(item, (list, tuple)):
            pending += item
    return sum(storages.values())


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
