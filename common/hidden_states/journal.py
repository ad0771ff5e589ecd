"""The journal of finished files and the resume scan: which rows a rerun of 02 need not extract again."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np
from tqdm import tqdm

from common.hidden_states.state_files import (
    FILE_DIGEST_CHARS,
    file_digest,
    is_valid_sample,
    sample_file_names,
)
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES, StateStorage

DIGEST_CHARS = 16  # hex characters of a journal's ids digest


def find_done(root: Path, ds, indices: set[int], hidden_size: int, chunk: int = 1000,
              storage: StateStorage = STORAGES[DEFAULT_STORAGE], verify: bool = False) -> tuple[set[int], int]:
    """(indices whose file is complete and matches its prepared row, count of files deleted
    because they were not): a resumed run keeps the first and redoes the rest.

    A file the journals list with its current size and the digest of its prepared row's ids is
    kept without being opened (one `stat` instead of a `torch.load`: the difference between
    seconds and many minutes for 500K files); any other file is loaded and checked. With
    `verify` (02 --verify), a listed file is also re-read whole and kept only if its bytes still
    have the digest recorded when it was written (a file damaged in place keeps its size)."""
    existing = sample_file_names(root)
    candidates = sorted(i for i in indices if i in existing)
    journal = read_journals(root)
    listed = [i for i in candidates if i in journal]
    digests = row_digests(ds, listed, chunk)
    done = {i for i in listed if (os.stat(existing[i]).st_size, digests[i]) in journal[i]}
    damaged: set[int] = set()
    if verify:
        done, damaged = _verified(existing, recorded_file_digests(root), digests, done)
        for i in damaged:
            os.unlink(existing[i])
    unsure = {i: Path(existing[i]) for i in candidates if i not in done and i not in damaged}
    checked, redo = _load_and_check(unsure, ds, sorted(unsure), hidden_size, chunk, storage)
    return done | checked, redo + len(damaged)


def _verified(existing: dict[int, str], recorded: dict[tuple[int, int, str], str], digests: dict[int, str],
              listed: set[int]) -> tuple[set[int], set[int]]:
    """(files among `listed` whose bytes still have the digest recorded when they were written,
    those whose bytes do not). A file without a recorded digest (a journal of an earlier
    version) is in neither: the caller loads and checks it like a file no journal lists."""
    good, damaged = set(), set()
    for i in tqdm(sorted(listed), desc="verify", unit="file", disable=len(listed) < 1000):
        digest = recorded.get((i, os.stat(existing[i]).st_size, digests[i]))
        if digest and file_digest(existing[i]) == digest:
            good.add(i)
        elif digest:
            tqdm.write(f"--verify: {existing[i]} no longer has the digest recorded when it was written; redoing it")
            damaged.add(i)
    return good, damaged


def _load_and_check(existing: dict[int, Path], ds, candidates: list[int], hidden_size: int,
                    chunk: int, storage: StateStorage) -> tuple[set[int], int]:
    done, redo = set(), 0
    column = ds.select_columns(["input_ids"])
    with tqdm(total=len(candidates), desc="check existing", unit="file", disable=len(candidates) < chunk) as bar:
        for start in range(0, len(candidates), chunk):
            part = candidates[start:start + chunk]
            for i, ids in zip(part, column[part]["input_ids"]):
                if is_valid_sample(existing[i], ids, hidden_size, storage):
                    done.add(i)
                else:
                    existing[i].unlink()
                    redo += 1
            bar.update(len(part))
    return done, redo


def journal_path(root: str | Path, shard_index: int, num_shards: int) -> Path:
    return Path(root) / f"extract_journal_{shard_index}_of_{num_shards}.txt"


def ids_digest(input_ids) -> str:
    """A short digest of a sample's token ids (any integer sequence or array)."""
    return hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=DIGEST_CHARS // 2).hexdigest()


class Journal:
    """One line per sample file this shard has finished, appended once the file is in place:
    `INDEX FILE_BYTES IDS_DIGEST FILE_DIGEST` (plain text: it parses several times faster than
    JSON lines at 500K lines; journals of earlier versions lack FILE_DIGEST). A kill can cut the
    last line short or lose the lines of the last files; either only means those files get
    checked the slow way on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: TextIO | None = path.open("a", encoding="utf-8")

    def add(self, index: int, file_bytes: int, digest: str, file_digest: str = "") -> None:
        if self.file is None:
            return
        try:
            self.file.write(f"{index} {file_bytes} {digest} {file_digest}".rstrip() + "\n")
            self.file.flush()
        except OSError:
            # A full disk. The journal only saves time on a restart, so it stops here and the run
            # goes on; the next sample file that cannot be written stops the run, naming the disk.
            self.close()

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # a flush of what a full disk refused
                self.file.close()
            self.file = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_journals(root: Path) -> dict[int, set[tuple[int, str]]]:
    """Index -> every (file size, ids digest) any journal in `root` lists for it."""
    records: dict[int, set[tuple[int, str]]] = {}
    for index, size, ids, _data in _journal_lines(root):
        records.setdefault(index, set()).add((size, ids))
    return records


def recorded_file_digests(root: Path) -> dict[tuple[int, int, str], str]:
    """(index, file size, ids digest) -> the file digest recorded when it was written, for the
    journal lines that carry one (02 --verify)."""
    return {(index, size, ids): data for index, size, ids, data in _journal_lines(root) if data}


def _journal_lines(root: Path) -> Iterator[tuple[int, int, str, str]]:
    """(index, file size, ids digest, file digest or "") of each well-formed line of the journals
    in `root`. Lines cut short or garbled (a kill, a damaged disk; bytes that are not UTF-8
    included) are left out: those files are checked the slow way."""
    for path in root.glob("extract_journal_*.txt"):
        for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
            fields = line.split(" ")  # split and length checks: faster than a regex at 500K lines
            data = fields[3] if len(fields) == 4 else ""
            numbers = fields[0] + fields[1] if len(fields) in (3, 4) else ""
            if (numbers.isdigit() and numbers.isascii() and len(fields[2]) == DIGEST_CHARS
                    and len(data) in (0, FILE_DIGEST_CHARS)):
                yield int(fields[0]), int(fields[1]), fields[2], data


def row_digests(ds, indices: list[int], chunk: int = 10_000) -> dict[int, str]:
    """`ids_digest` of the prepared rows `indices`, read as Arrow buffers (no Python lists)."""
    column = ds.select_columns(["input_ids"]).with_format("arrow")
    digests = {}
    for start in range(0, len(indices), chunk):
        part = indices[start:start + chunk]
        ids = column[part].column(0).combine_chunks()
        offsets, values = np.asarray(ids.offsets), ids.values.to_numpy()
        digests.update((i, ids_digest(values[offsets[k]:offsets[k + 1]])) for k, i in enumerate(part))
    return digests


# --- folder identity, manifests and the merge ----------------------------------------------
