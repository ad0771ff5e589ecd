"""Reading conversation records from input files: each record as its file holds it, named, for
`common.prepare.conversations.to_conversation` to normalise.

Inputs are JSONL, JSON (a list of records or `{"data": [...]}`), Parquet, a saved Hugging Face
dataset (`save_to_disk`), or a folder holding any of these. A record is named `<file>:<line>`
(JSONL, from 1) or `<file>:<row>` (other formats, from 0); an `id` in the record names it instead
(`to_conversation`).

A file that cannot be read at all is a `PipelineError` naming it; a record that cannot be decoded
(a JSONL line that is not UTF-8 or not JSON, a string holding a lone surrogate) is a `Rejection`
with a reason, so the caller skips and counts it and the run goes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from datasets import DatasetDict, load_from_disk

from common.errors import PipelineError
from common.prepare.conversations import MALFORMED_RECORD, Rejection

__all__ = ["Record", "FORMATS", "SUFFIXES", "resolve_inputs", "iter_records"]

BOM = "\ufeff"  # a UTF-8 byte-order mark, as some editors write at a file's start
UNDECODABLE = "undecodable_text"  # a drop reason (the report's key): bytes that are not UTF-8, or a lone surrogate

Record = tuple[str, Any]  # (sample_id, the record as its file holds it, or a Rejection)


def read_jsonl(path: Path) -> Iterator[Record]:
    """One record per non-blank line. A line that is not UTF-8 or not JSON, or whose strings hold
    a lone surrogate (`"\\ud83d"` without its pair: valid JSON, but no UTF-8 text can hold
    it), is a Rejection naming the line; a byte-order mark before the first record is dropped."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            sample_id = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield sample_id, Rejection(UNDECODABLE, f"not UTF-8 text (byte {e.object[e.start]:#04x} at column "
                                                        f"{e.start + 1})")
                continue
            if number == 1:
                line = line.removeprefix(BOM)
            if not line.strip():
                continue
            try:
                yield sample_id, _without_lone_surrogates(json.loads(line), _may_hold_surrogates(line))
            except json.JSONDecodeError as e:
                yield sample_id, Rejection(MALFORMED_RECORD, f"not valid JSON ({e.msg})")


def _may_hold_surrogates(text: str) -> bool:
    """Only JSON text with a `\\u` escape of a surrogate (`\\ud800`..`\\udfff`) can produce one."""
    return "\\ud" in text or "\\uD" in text


def _without_lone_surrogates(record: Any, may_hold: bool) -> Any:
    """`record`, or a Rejection if one of its strings holds a lone UTF-16 surrogate (walked only
    when the text `may_hold` one)."""
    if not may_hold:
        return record
    bad = next((c for text in _strings(record) if not _encodable(text) for c in text if 0xD800 <= ord(c) <= 0xDFFF),
               None)
    return record if bad is None else Rejection(UNDECODABLE, f"a string holds a lone surrogate \\u{ord(bad):04x} "
                                                             "(a \\u escape without its pair)")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_json_records(path: Path) -> Iterator[Record]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the JSON
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: not a valid JSON file ({e})") from e
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise PipelineError(f"{path}: unknown JSON layout (expected a list of conversations or {{\"data\": [...]}})")
    may_hold = _may_hold_surrogates(text)
    for sample_id, record in _rows(path, data):
        yield sample_id, _without_lone_surrogates(record, may_hold)


def read_parquet(path: Path) -> Iterator[Record]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise PipelineError(f"{path}: not a readable Parquet file ({e})") from e
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        records = batch.to_pylist()
        yield from _rows(path, records, start=row)
        row += len(records)


def read_hf_dataset(path: Path) -> Iterator[Record]:
    """A folder written by `Dataset.save_to_disk` (or a `DatasetDict`: its splits in name order)."""
    try:
        data = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise PipelineError(f"{path}: not a readable saved Hugging Face dataset ({e})") from e
    splits = {name: data[name] for name in sorted(data)} if isinstance(data, DatasetDict) else {"": data}
    for name, split in splits.items():
        yield from _rows(Path(f"{path}/{name}") if name else path, split)


def _rows(path: Path, records: Iterable[Any], start: int = 0) -> Iterator[Record]:
    for row, record in enumerate(records, start=start):
        yield f"{path}:{row}", record


FORMATS: dict[str, Callable[[Path], Iterator[Record]]] = {
    "jsonl": read_jsonl,
    "json": read_json_records,
    "parquet": read_parquet,
    "hf_dataset": read_hf_dataset,
}
SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# A stage's report (00's regenerate_report.json in the folder it writes) is not conversations,
# nor are the configuration files a model or dataset folder often holds beside them.
REPORT_SUFFIX = "_report.json"
NOT_CONVERSATIONS = frozenset({"config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
                               "special_tokens_map.json", "preprocessor_config.json", "adapter_config.json",
                               "model.safetensors.index.json"})


def _is_hf_dataset(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in HF_DATASET_MARKERS)


def resolve_inputs(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Each input as (file or dataset folder, format name); a plain folder is expanded into the
    data files and saved datasets under it (sorted; other and hidden files, stage reports
    `*_report.json` and configuration files such as `config.json` are ignored).
    Errors name the path."""
    sources = []
    for path in map(Path, paths):
        if not path.exists():
            raise PipelineError(f"input {path}: no such file or folder")
        if path.is_file() and path.suffix.lower() not in SUFFIXES:
            raise PipelineError(f"input {path}: unknown format '{path.suffix}' "
                                f"(expected {', '.join(SUFFIXES)}, a saved Hugging Face dataset, or a folder of them)")
        found = _expand(path)
        if not found:
            raise PipelineError(f"input {path}: unknown format (the folder holds no {', '.join(SUFFIXES)} files "
                                f"and is not a saved Hugging Face dataset)")
        sources += found
    return sources


def _expand(path: Path) -> list[tuple[Path, str]]:
    if path.is_file():
        return [(path, SUFFIXES[path.suffix.lower()])] if path.suffix.lower() in SUFFIXES else []
    if _is_hf_dataset(path):
        return [(path, "hf_dataset")]
    return [s for child in sorted(path.iterdir()) if not child.name.startswith(".")
            and not child.name.endswith(REPORT_SUFFIX) and child.name not in NOT_CONVERSATIONS for s in _expand(child)]


def iter_records(sources: Iterable[tuple[Path, str]]) -> Iterator[Record]:
    for path, fmt in sources:
        yield from FORMATS[fmt](path)
