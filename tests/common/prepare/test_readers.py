"""common/prepare/readers.py: every input format read into the same conversations (JSONL, JSON,
Parquet, saved Hugging Face datasets and folders of them), undecodable lines (a reason each, the line
named) and unreadable files (an error naming them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from common.errors import PipelineError
from common.prepare.conversations import Conversation, Rejection, to_conversation
from common.prepare.readers import UNDECODABLE, iter_records, read_jsonl, resolve_inputs

OPENAI = [
    {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                             {"role": "assistant", "content": "A1", "reasoning_content": "R1"}]},
    {"messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]},
]
WANT = [(("system", "S", None), ("user", "Q1", None), ("assistant", "A1", "R1")),
        (("user", "Q2", None), ("assistant", "A2", None))]


def _read(*paths) -> list[Conversation | Rejection]:
    return [to_conversation(sid, record) for sid, record in iter_records(resolve_inputs(paths))]


def _triples(conversation: Conversation) -> tuple:
    return tuple((m.role, m.content, m.reasoning) for m in conversation.messages)


def _write_all_formats(folder: Path) -> dict[str, Path]:
    folder.mkdir()
    paths = {"jsonl": folder / "c.jsonl", "json": folder / "c.json", "json_data": folder / "d.json",
             "parquet": folder / "c.parquet", "hf_dataset": folder / "saved"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in OPENAI), encoding="utf-8")
    paths["json"].write_text(json.dumps(OPENAI), encoding="utf-8")
    paths["json_data"].write_text(json.dumps({"data": OPENAI}), encoding="utf-8")
    Dataset.from_list(OPENAI).to_parquet(str(paths["parquet"]))
    Dataset.from_list(OPENAI).save_to_disk(str(paths["hf_dataset"]))
    return paths


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    return _write_all_formats(tmp_path_factory.mktemp("formats") / "inputs")


@pytest.mark.parametrize("fmt", ["jsonl", "json", "json_data", "parquet", "hf_dataset"])
def test_each_format_reads_the_same_conversations(formats, fmt):
    conversations = _read(formats[fmt])
    assert [_triples(c) for c in conversations] == WANT
    assert conversations[0].sample_id == "a"
    # No id: the file and line (JSONL, from 1) or row (from 0).
    assert conversations[1].sample_id == f"{formats[fmt]}:{2 if fmt == 'jsonl' else 1}"


def test_folder_reads_every_file_and_saved_dataset(formats):
    sources = resolve_inputs([formats["jsonl"].parent])
    assert sorted(fmt for _, fmt in sources) == ["hf_dataset", "json", "json", "jsonl", "parquet"]
    assert [_triples(c) for c in _read(formats["jsonl"].parent)] == WANT * 5


def test_saved_dataset_dict_reads_its_splits_in_order(tmp_path):
    DatasetDict({"train": Dataset.from_list(OPENAI[1:]), "test": Dataset.from_list(OPENAI[:1])}).save_to_disk(
        str(tmp_path / "dd"))
    conversations = _read(tmp_path / "dd")
    assert [_triples(c) for c in conversations] == WANT
    assert conversations[1].sample_id == f"{tmp_path / 'dd'}/train:0"


def test_input_errors_name_the_path(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{oops")
    (tmp_path / "dict.json").write_text('{"rows": []}')
    (tmp_path / "bad.parquet").write_text("x")
    (tmp_path / "broken_dataset").mkdir()
    (tmp_path / "broken_dataset" / "state.json").write_text("{")
    for path, message in ((tmp_path / "missing.jsonl", "no such file"), (tmp_path / "notes.txt", "unknown format"),
                          (tmp_path / "empty", "unknown format")):
        with pytest.raises(PipelineError, match=message) as e:
            resolve_inputs([path])
        assert str(path) in str(e.value)
    for path in ("bad.json", "dict.json", "bad.parquet", "broken_dataset"):
        with pytest.raises(PipelineError, match=f"{tmp_path / path}: "):
            _read(tmp_path / path)


def test_undecodable_lines_are_rejections_naming_the_line_and_a_bom_is_read_past(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"messages": []}\n{"a": "\xff"}\n{"a": "\\udc00 x"}\n{"a": "\\ud83d\\ude00"}\n')
    records = list(read_jsonl(path))
    assert records[0] == (f"{path}:1", {"messages": []})
    assert records[1] == (f"{path}:2", Rejection(UNDECODABLE, "not UTF-8 text (byte 0xff at column 8)"))
    assert records[2] == (f"{path}:3", Rejection(UNDECODABLE, "a string holds a lone surrogate \\udc00 (a \\u escape "
                                                              "without its pair)"))
    assert records[3] == (f"{path}:4", {"a": "\N{GRINNING FACE}"})
