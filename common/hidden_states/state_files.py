"""The data_{i}.pt files of a hidden-state folder: naming, saving, checking, listing (layout: data_config.py)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch

from common.atomic import (
    TMP_PREFIX,
    atomic_path,
    failed_write,
    save_whole,
    write_error,
)
from common.errors import PipelineError
from common.hidden_states.data_config import (
    FILES_PER_FOLDER,
    NUM_STATES,
)
from common.hidden_states.storage import DEFAULT_STORAGE, SCALES_KEY, STORAGES, StateStorage

SAMPLE_RE = re.compile(r"data_(\d+)\.pt")
FILE_DIGEST_CHARS = 32  # hex characters of a journal's file digest


def sample_path(root: str | Path, index: int) -> Path:
    """The one place that formats a sample's file name (`sample_index` parses it)."""
    return Path(root) / f"{index // FILES_PER_FOLDER:05d}" / f"data_{index}.pt"


def sample_index(path: str | Path) -> int | None:
    match = SAMPLE_RE.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def save_sample(root: str | Path, index: int, input_ids: torch.Tensor, states: list[torch.Tensor],
                loss_mask: torch.Tensor, scales: torch.Tensor | None = None) -> int:
    """Write one sample atomically (with its fp8 scales, if any); return the file's size in bytes.
    torch reports a full disk as a RuntimeError that does not say so: the error names the file and
    the space left."""
    path = sample_path(root, index)
    data = {"input_ids": input_ids, "hidden_states": states, "loss_mask": loss_mask}
    if scales is not None:
        data[SCALES_KEY] = scales
    try:
        with atomic_path(path) as tmp:
            return save_whole(data, tmp)
    except OSError as e:
        raise PipelineError(write_error(e, path)) from e
    except RuntimeError as e:  # torch's wording of a failed write (a full disk among others)
        raise PipelineError(failed_write(path, f"{type(e).__name__}: {str(e).strip().splitlines()[0]}")) from e


def is_valid_sample(path: Path, input_ids: list[int], hidden_size: int,
                    storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> bool:
    """True when `path` loads and holds `input_ids` with four [S, hidden] states (and scales) of
    `storage`.

    Loading with mmap reads the zip directory at the end of the file (a truncated file fails)
    and the small tensors, not the hidden states."""
    try:
        data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any failure to read means "redo this sample"
        return False
    if not storage.holds(data, NUM_STATES, (len(input_ids), hidden_size)) or set(data) != storage.keys:
        return False
    ids, mask = data["input_ids"], data["loss_mask"]
    return (isinstance(mask, torch.Tensor) and tuple(mask.shape) == (len(input_ids),)
            and isinstance(ids, torch.Tensor) and ids.tolist() == list(input_ids))


def file_digest(path: str | Path) -> str:
    """A digest of a file's bytes, read in 8 MB pieces (the journal records it when 02 writes the file)."""
    digest = hashlib.blake2b(digest_size=FILE_DIGEST_CHARS // 2)
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


def list_sample_files(root: Path) -> dict[int, Path]:
    """Index -> path of every data file under `root`. Any other `*pt` file is refused:
    speculators' dataset would load it as a sample."""
    return {i: Path(path) for i, path in sample_file_names(root).items()}


def sample_file_names(root: Path) -> dict[int, str]:
    """`list_sample_files` with plain strings: building a `Path` costs more than the scan itself
    when a folder holds 500K files."""
    found = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if not name.endswith("pt"):
                continue
            match = SAMPLE_RE.fullmatch(name)
            if match is None:
                raise PipelineError(f"output folder {root} holds {Path(folder) / name}, which is not a hidden-state "
                                    "file (speculators' dataset loads every *pt file); use another --output")
            found[int(match.group(1))] = os.path.join(folder, name)
    return found


def remove_own_temporaries(root: Path, indices: set[int], manifest: Path) -> int:
    """Delete leftovers of a killed run, only those of this shard's samples and manifest:
    another shard may be writing its own temporaries into the same folder right now."""
    count = 0
    for tmp in root.rglob(TMP_PREFIX + "*"):
        name = tmp.name[len(TMP_PREFIX):]
        index = sample_index(name.split(".pt.")[0] + ".pt") if ".pt." in name else None
        if (index is not None and index in indices) or name.startswith(manifest.name + "."):
            tmp.unlink(missing_ok=True)
            count += 1
    return count


# --- the journal of finished files (the resume scan reads it instead of the files) ----------
