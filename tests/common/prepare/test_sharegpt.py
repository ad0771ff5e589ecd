"""common/prepare/sharegpt.py: the records of a JSON array cut off inside a record, the conversations kept,
the seeded selection (a larger --num extends a smaller one) and the file written, from a small wheel made
here (the real one is fetched from the package index, never by these tests); common/wheels.py's checks."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from common import wheels
from common.errors import PipelineError
from common.prepare import sharegpt
from common.prepare.conversations import to_conversation
from common.prepare.sharegpt import MEMBER, fetch_sharegpt, read_records, select, usable


def chat(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": who, "value": text} for who, text in turns]}


GOOD = [chat(i, ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(30)]
BAD = [chat(100, ("gpt", "an answer with no question")), chat(101, ("human", "a question, no answer")),
       chat(102, ("human", "hi"), ("bing", "hello")), chat(103, ("human", " "), ("gpt", "?")),
       {"id": "c104", "conversations": []}]


def test_records_of_an_array_cut_off_inside_a_record():
    text = json.dumps(GOOD[:3], indent=2)
    assert read_records(text) == GOOD[:3]
    cut = text[:text.index('"c2"') + 10]  # inside the third record
    assert read_records(cut) == GOOD[:2]
    assert read_records("[]") == [] and read_records('[\n  {"a": 1},') == [{"a": 1}]
    with pytest.raises(PipelineError, match="not a JSON array"):
        read_records('{"a": 1}')


def test_usable_conversations_are_chats_01_trains_on():
    assert all(usable(r) for r in GOOD) and not any(usable(r) for r in BAD)
    assert usable(chat(1, ("human", "a"), ("human", "b"), ("gpt", "c")))  # two questions in a row
    for record in GOOD[:3]:
        conversation = to_conversation("x", record)
        assert [m.role for m in conversation.messages] == ["user", "assistant"]


def test_selection_is_seeded_and_a_larger_num_extends_a_smaller_one():
    records = BAD[:2] + GOOD + BAD[2:]
    ten, twenty = select(records, 10, seed=0), select(records, 20, seed=0)
    assert twenty[:10] == ten and len({r["id"] for r in twenty}) == 20 and all(usable(r) for r in twenty)
    assert select(records, 10, seed=1) != ten and select(records, 10, seed=0) == ten
    with pytest.raises(PipelineError, match="--num 31: the wheel's file holds 30 usable conversations"):
        select(records, 31, seed=0)


def fake_wheel(tmp_path: Path, records: list[dict]) -> Path:
    """A wheel holding `records` as the data set's file, cut off inside the last record."""
    text = json.dumps(records, indent=2)
    path = tmp_path / sharegpt.WHEEL.filename
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, text[:-40])
    return path


def test_fetch_writes_jsonl_that_01_reads(tmp_path, monkeypatch):
    path = fake_wheel(tmp_path, GOOD + BAD)
    monkeypatch.setattr(sharegpt, "ensure_wheel", lambda wheel: path)
    out, complete = fetch_sharegpt(5, seed=3, out=tmp_path / "out" / "five.jsonl")
    assert complete == len(GOOD + BAD) - 1  # the cut record is left out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == select(GOOD + BAD, 5, seed=3) and set(rows[0]) == {"id", "conversations"}
    assert sharegpt.default_output(5, 3).relative_to(sharegpt.SHAREGPT_DIR).as_posix() == "sharegpt_5_seed3.jsonl"
    with pytest.raises(PipelineError, match="--num 0: must be at least 1"):
        fetch_sharegpt(0, out=tmp_path / "none.jsonl")


def test_a_cached_wheel_is_used_and_a_download_is_checked(tmp_path, monkeypatch):
    pinned = wheels.PinnedWheel("pkg", "1.0", "pkg-1.0-py3-none-any.whl", "0" * 64)
    (tmp_path / pinned.filename).write_bytes(b"cached")
    assert wheels.ensure_wheel(pinned, cache_dir=tmp_path) == tmp_path / pinned.filename  # no download

    def fake_pip(cmd, **kwargs):  # `pip download --dest DIR pkg==1.0` writing a file of other contents
        dest = cmd[cmd.index("--dest") + 1]
        (Path(dest) / pinned.filename).write_bytes(b"not the published wheel")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(wheels.subprocess, "run", fake_pip)
    other = tmp_path / "other"
    with pytest.raises(PipelineError, match="sha256 .* expected .not the published wheel"):
        wheels.ensure_wheel(pinned, cache_dir=other)
    assert list(other.iterdir()) == []  # nothing kept
    with zipfile.ZipFile(tmp_path / "w.whl", "w") as z:
        z.writestr("a/b.txt", "text")
    with wheels.open_member(tmp_path / "w.whl", "a/b.txt") as f:
        assert f.read() == b"text"
    with pytest.raises(PipelineError, match="w.whl has no a/c.txt"):
        wheels.open_member(tmp_path / "w.whl", "a/c.txt")
