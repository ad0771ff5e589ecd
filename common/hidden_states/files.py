"""The hidden-state folder written by step 02 and read by step 04.

Layout (speculators' v1 sample format; every field in docs/FILES.md):

    OUT/00000/data_0.pt ... OUT/00049/data_499999.pt   one file per prepared row i, grouped
                                                      by i // 10000 to keep folders small
    OUT/extract_shard_{j}_of_{k}.json                 one manifest per shard (identity, lengths,
                                                      failed samples, finished flag)
    OUT/extract_journal_{j}_of_{k}.txt                the files each shard has finished (size, ids
                                                      digest): the resume scan reads it, not the files
    OUT/sample_lengths.json                           {"i": S} of every data file in the folder
    OUT/data_config.json                              DataConfig: what produced the files

Each `data_{i}.pt` is `{"input_ids": int64[S], "hidden_states": [bf16[S, H]] * 4,
"loss_mask": int64[S]}`: three auxiliary layers (ids in the vLLM convention), then the
post-norm final state. With `--storage fp8` the states are float8 e4m3 and the file also holds
`"hidden_state_scales": bf16[4, S]` (common/hidden_states/storage.py). Files are written under a
temporary name and renamed, so a file under its final name is complete.

Several shards may write into one folder at once. Each keeps its own manifest; whichever shard
finishes last (it sees every manifest of its run marked finished) merges them into
`sample_lengths.json` and `data_config.json`. A merge lists exactly the data files present on
disk, so the two files are consistent with the folder whenever they are written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from tqdm import tqdm

from common.atomic import (
    TMP_PREFIX,
    atomic_path,
    failed_write,
    format_bytes,
    read_json,
    save_whole,
    write_error,
    write_json,
)
from common.data.fingerprints import prepared_fingerprint
from common.data.prepared_dataset import PrepareReport
from common.errors import PipelineError
from common.hidden_states.storage import DEFAULT_STORAGE, SCALES_KEY, STORAGES, StateStorage
from common.target.config import TargetInfo

FORMAT_VERSION = 1
DATA_FORMAT = "speculators-v1"
LAST_STATE = "post_norm"  # the final state is the input of lm_head (HF hidden_states[N])
NUM_STATES = 4  # three auxiliary layers, then the final state
FILES_PER_FOLDER = 10_000
DATA_CONFIG = "data_config.json"
SAMPLE_LENGTHS = "sample_lengths.json"
SAMPLE_RE = re.compile(r"data_(\d+)\.pt")
LOCK_FORMAT = ".extract_lock_{shard}_of_{shards}"  # held while a 02 writes that shard (see shard_lock)
MANIFEST_RE = re.compile(r"extract_shard_(\d+)_of_(\d+)\.json")
# What must agree between a folder's existing files and a new run writing into it.
IDENTITY_FIELDS = ("architecture", "text_architecture", "hidden_size", "num_layers", "vocab_size",
                   "layer_ids", "last_state", "storage", "dtype", "format_version")
DIGEST_CHARS = 16  # hex characters of a journal's ids digest
FILE_DIGEST_CHARS = 32  # hex characters of a journal's file digest
PACKAGES = ("torch", "transformers", "speculators", "datasets")


@dataclass
class DataConfig:
    """`data_config.json`: the target and choices behind a hidden-state folder, and its counts."""

    target: str
    architecture: str
    text_architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_ids: list[int]  # auxiliary layers, vLLM convention (HF hidden_states[i])
    compute_dtype: str
    max_len: int
    prepared: str
    tokenizer: str
    chat_template_sha256: str
    last_state: str = LAST_STATE
    storage: str = DEFAULT_STORAGE  # "bf16" or "fp8" (common/hidden_states/storage.py); absent in older folders: bf16
    dtype: str = "bfloat16"  # dtype of the stored hidden states
    scales: str | None = None  # where the fp8 scales are, per token row of each state
    package_versions: dict[str, str] = field(default_factory=dict)
    num_shards: int = 1
    sample_count: int = 0
    token_count: int = 0
    bytes_total: int = 0
    failed: list[dict] = field(default_factory=list)  # {"index", "sample_id", "error"}
    data_format: str = DATA_FORMAT
    format_version: int = FORMAT_VERSION
    prepared_fingerprint: str = ""  # common/data/fingerprints.py; "" in folders of earlier versions

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in IDENTITY_FIELDS}

    def save(self, folder: str | Path) -> None:
        write_json(Path(folder) / DATA_CONFIG, asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> DataConfig:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @classmethod
    def load(cls, folder: str | Path) -> DataConfig:
        path = Path(folder) / DATA_CONFIG
        if not path.is_file():
            raise PipelineError(f"hidden states {folder}: no {DATA_CONFIG} (run 02_extract_hidden_states.py first)")
        data = read_json(path)
        if data.get("format_version") != FORMAT_VERSION:
            raise PipelineError(f"{path}: format version {data.get('format_version')}, expected {FORMAT_VERSION}")
        return cls.from_dict(data)


def package_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in PACKAGES}


def new_data_config(info: TargetInfo, layer_ids: list[int], compute_dtype: torch.dtype, prepared: Path,
                    report: PrepareReport, storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> DataConfig:
    scales = "hidden_state_scales: bfloat16[4, S], one per token row of each state" if storage.scaled else None
    return DataConfig(
        target=info.path, architecture=info.architecture, text_architecture=info.text_architecture,
        hidden_size=info.hidden_size, num_layers=info.num_layers, vocab_size=info.vocab_size,
        layer_ids=list(layer_ids), compute_dtype=str(compute_dtype).removeprefix("torch."),
        max_len=report.max_len, prepared=str(Path(prepared).resolve()), tokenizer=report.tokenizer,
        chat_template_sha256=report.chat_template_sha256, storage=storage.name, dtype=storage.dtype_name,
        scales=scales, package_versions=package_versions(), prepared_fingerprint=prepared_fingerprint(prepared))


# --- sample files -------------------------------------------------------------------------


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


def find_done(root: Path, ds, indices: set[int], hidden_size: int, chunk: int = 1000,
              storage: StateStorage = STORAGES[DEFAULT_STORAGE], verify: bool = False) -> tuple[set[int], int]:
    """(indices whose file is complete and matches its prepared row, count of files deleted
    because they were not): a resumed run keeps the first and redoes the rest.

    A file the journals list with its current size and the digest of its prepared row's ids is
    kept without being opened (one `stat` instead of a `torch.load`: the difference between
    seconds and many minutes for 500K files); any other file is loaded and checked. With
    `verify` (02 --verify), a listed file is also re-read whole and kept only if its bytes still
    have the digest recorded when it was written (a file damaged in place keeps its size)."""
    existing = _sample_file_names(root)
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


def file_digest(path: str | Path) -> str:
    """A digest of a file's bytes, read in 8 MB pieces (the journal records it when 02 writes the file)."""
    digest = hashlib.blake2b(digest_size=FILE_DIGEST_CHARS // 2)
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


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


def list_sample_files(root: Path) -> dict[int, Path]:
    """Index -> path of every data file under `root`. Any other `*pt` file is refused:
    speculators' dataset would load it as a sample."""
    return {i: Path(path) for i, path in _sample_file_names(root).items()}


def _sample_file_names(root: Path) -> dict[int, str]:
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


def manifest_path(root: str | Path, shard_index: int, num_shards: int) -> Path:
    return Path(root) / f"extract_shard_{shard_index}_of_{num_shards}.json"


def check_output_folder(root: Path, config: DataConfig) -> None:
    """Refuse a folder holding files of another target or layer choice, before touching it."""
    manifests = sorted(p for p in root.glob("extract_shard_*.json") if MANIFEST_RE.fullmatch(p.name))
    sources = [root / DATA_CONFIG, *manifests]
    found_any = False
    for source in sources:
        if not source.is_file():
            continue
        try:
            data = read_json(source)
            theirs = DataConfig.from_dict(data.get("config", data)).identity()
        except (ValueError, TypeError, KeyError) as e:
            raise PipelineError(f"output folder {root}: cannot read {source.name} ({e}); use another --output") from e
        found_any = True
        for key, ours in config.identity().items():
            if theirs[key] != ours:
                raise PipelineError(
                    f"output folder {root} holds hidden states of another target or layer or storage choice "
                    f"({key} {theirs[key]} in {source.name}, {ours} now); use another --output or delete the folder")
    if not found_any and any(root.rglob("data_*.pt")):
        raise PipelineError(f"output folder {root} holds data files but no {DATA_CONFIG}: it was not written by "
                            "this step; use another --output")


def write_manifest(path: Path, config: DataConfig, lengths: dict[int, int], failed: list[dict],
                   finished: bool) -> None:
    write_json(path, {"config": asdict(config), "finished": finished, "failed": failed,
                      "lengths": {str(i): n for i, n in sorted(lengths.items())}})


def merge_manifests(root: Path, num_shards: int) -> DataConfig | None:
    """Write `sample_lengths.json` and `data_config.json` when every shard of the run has
    finished; return the merged config, or None while some shard is still running."""
    manifests = []
    for j in range(num_shards):
        path = manifest_path(root, j, num_shards)
        if not path.is_file():
            return None
        manifests.append(read_json(path))
    if not all(m["finished"] for m in manifests):
        return None
    # Entries of an earlier run (e.g. a larger --max-samples) stay as long as their file does.
    old = root / SAMPLE_LENGTHS
    lengths = {int(i): n for i, n in read_json(old).items()} if old.is_file() else {}
    for m in manifests:
        lengths.update({int(i): n for i, n in m["lengths"].items()})
    on_disk = list_sample_files(root)
    lengths = {i: n for i, n in sorted(lengths.items()) if i in on_disk}
    config = DataConfig.from_dict(manifests[0]["config"])
    config.num_shards = num_shards
    config.sample_count = len(lengths)
    config.token_count = sum(lengths.values())
    config.bytes_total = sum(on_disk[i].stat().st_size for i in lengths)
    config.failed = sorted((f for m in manifests for f in m["failed"] if f["index"] not in lengths),
                           key=lambda f: f["index"])
    write_json(root / SAMPLE_LENGTHS, {str(i): n for i, n in lengths.items()})
    config.save(root)
    return config


def remove_stale_rows(root: Path, config: DataConfig, num_rows: int) -> int:
    """When the folder was last written from another prepared dataset (01 was run again), delete
    the files of rows past this dataset's end and forget the merged lists: they belong to rows
    that no longer exist, which 04 would train on and 05 index past the end. Rows within range
    are checked against their prepared row as on any resume. Returns the files deleted."""
    if not (root / DATA_CONFIG).is_file():
        return 0
    previous = DataConfig.from_dict(read_json(root / DATA_CONFIG)).prepared_fingerprint
    if previous == config.prepared_fingerprint:
        return 0
    stale = [path for i, path in _sample_file_names(root).items() if i >= num_rows]
    for path in stale:
        os.unlink(path)
    (root / SAMPLE_LENGTHS).unlink(missing_ok=True)  # the merge starts from this run's manifests
    return len(stale)


@contextlib.contextmanager
def shard_lock(root: Path, shard_index: int, num_shards: int) -> Iterator[None]:
    """Hold this shard's lock on `root` for the block: a second 02 writing the same shard into
    the same folder (a command started twice, a job scheduled twice) would redo the same work and
    race on every file, so it is refused, naming the process that holds the lock. The kernel drops
    a lock when its process dies (SIGKILL included); the file is removed on a normal exit."""
    path = root / LOCK_FORMAT.format(shard=shard_index, shards=num_shards)
    while True:
        file = path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process"
            file.close()
            raise PipelineError(f"output folder {root}: {holder} is writing shard {shard_index} of {num_shards} into "
                                "it; wait for it to finish (or stop it), then run the same command again") from None
        if path.exists() and os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
            break
        file.close()  # the holder removed the file between our open and lock: lock the new one
    file.seek(0)
    file.truncate()
    file.write(f"02_extract_hidden_states.py (pid {os.getpid()} on {socket.gethostname()})")
    file.flush()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        file.close()


def check_disk(root: Path, needed_bytes: int) -> None:
    """Refuse to start when the output disk cannot hold the estimated files."""
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if needed_bytes > free:
        raise PipelineError(f"output disk of {root} has {format_bytes(free)} free, the samples still to extract "
                            f"need about {format_bytes(needed_bytes)}; free space, choose another --output, "
                            "or pass --skip-disk-check")
