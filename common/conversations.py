"""Reading conversations: input files of several formats, normalised to one message schema.

Inputs are JSONL, JSON (a list of records or `{"data": [...]}`), Parquet, a saved Hugging Face
dataset (`save_to_disk`), or a folder holding any of these. A record is a conversation in
OpenAI form, `{"messages": [{"role", "content", "reasoning_content"?}]}`, or ShareGPT form,
`{"conversations": [{"from", "value"}]}`; an optional `id` names it, else it is named
`<file>:<line>` (JSONL, from 1) or `<file>:<row>` (other formats, from 0).

A file that cannot be read at all is a `PipelineError` naming it; one bad record is a
`Rejection` with a reason, so the caller skips and counts it and the run goes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import PipelineError

__all__ = [
    "Message", "Conversation", "Rejection", "FORMATS", "SUFFIXES", "resolve_inputs", "iter_records",
    "to_conversation",
]

# ShareGPT `from` values and OpenAI roles, mapped to the roles chat templates know.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}

# Drop reasons of this stage (the report's keys).
MALFORMED_RECORD = "malformed_record"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT_TURN = "no_assistant_turn"
EMPTY_CONTENT = "empty_content"
NON_STRING_CONTENT = "non_string_content"


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str
    reasoning: str | None = None  # the assistant's thinking, rendered by the template


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Rejection:
    """Why one record was skipped: a drop reason of the report and a detail for the warning."""

    reason: str
    detail: str


# --- readers: path -> (sample_id, record or Rejection) -------------------------------------

Record = tuple[str, Any]


def read_jsonl(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{number}", Rejection(MALFORMED_RECORD, f"not valid JSON ({e.msg})")


def read_json(path: Path) -> Iterator[Record]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: not a valid JSON file ({e})") from e
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise PipelineError(f"{path}: unknown JSON layout (expected a list of conversations or {{\"data\": [...]}})")
    yield from _rows(path, data)


def read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    from datasets import DatasetDict, load_from_disk

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
    "json": read_json,
    "parquet": read_parquet,
    "hf_dataset": read_hf_dataset,
}
SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _is_hf_dataset(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in HF_DATASET_MARKERS)


def resolve_inputs(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Each input as (file or dataset folder, format name); a plain folder is expanded into the
    data files and saved datasets under it (sorted; other and hidden files are ignored).
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
    return [s for child in sorted(path.iterdir()) if not child.name.startswith(".") for s in _expand(child)]


def iter_records(sources: Iterable[tuple[Path, str]]) -> Iterator[Record]:
    for path, fmt in sources:
        yield from FORMATS[fmt](path)


# --- normalisation: record -> Conversation or Rejection ---------------------------------------

def _openai_message(m: Any) -> tuple[Any, Any, Any]:
    return m.get("role"), m.get("content"), m.get("reasoning_content")


def _sharegpt_message(m: Any) -> tuple[Any, Any, Any]:
    return m.get("from"), m.get("value"), None


# Record key -> reader of one message as (role, content, reasoning).
CONVERSATION_FORMS: dict[str, Callable[[dict], tuple[Any, Any, Any]]] = {
    "messages": _openai_message,
    "conversations": _sharegpt_message,
}


def _sample_id(default: str, record: dict) -> str:
    rid = record.get("id")
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid) else default


def to_conversation(default_id: str, record: Any) -> Conversation | Rejection:
    """Normalise one record; a Rejection says why it cannot be used."""
    if isinstance(record, Rejection):
        return record
    if not isinstance(record, dict):
        return Rejection(MALFORMED_RECORD, f"a record must be an object, got {type(record).__name__}")
    form = next((key for key in CONVERSATION_FORMS if isinstance(record.get(key), list)), None)
    if form is None:
        return Rejection(MALFORMED_RECORD, "no 'messages' or 'conversations' list")
    messages = []
    for turn in record[form]:
        if not isinstance(turn, dict):
            return Rejection(MALFORMED_RECORD, f"a message must be an object, got {type(turn).__name__}")
        message = _message(*CONVERSATION_FORMS[form](turn))
        if isinstance(message, Rejection):
            return message
        messages.append(message)
    if not any(m.role == "assistant" for m in messages):
        return Rejection(NO_ASSISTANT_TURN, f"roles {[m.role for m in messages]}")
    return Conversation(_sample_id(default_id, record), tuple(messages))


def _message(role: Any, content: Any, reasoning: Any) -> Message | Rejection:
    role = role.lower() if isinstance(role, str) else role
    if not isinstance(role, str) or role not in ROLES:
        return Rejection(UNKNOWN_ROLE, f"role {role!r}")
    if not isinstance(content, str) or not (reasoning is None or isinstance(reasoning, str)):
        bad = content if not isinstance(content, str) else reasoning
        return Rejection(NON_STRING_CONTENT, f"{ROLES[role]} content of type {type(bad).__name__}")
    if not content.strip():
        return Rejection(EMPTY_CONTENT, f"empty {ROLES[role]} message")
    # An empty thinking block is no thinking: the template then renders the turn as without it.
    return Message(ROLES[role], content, reasoning or None)
