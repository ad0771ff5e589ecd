"""Step 01 end to end: bad-input counting, the report, truncation, subsets and workers, the
prepared folder against the masker, the demo data, and the script's output and error exits (the
readers and masks themselves: tests/common/prepare/)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_in_process, run_script

from common.errors import PipelineError
from common.prepare.conversations import Conversation, to_conversation
from common.prepare.prepare import PrepareOptions, prepare, summary_lines, warning_lines
from common.prepare.prepared_dataset import COLUMNS, PrepareReport, load_prepared
from common.prepare.readers import iter_records, resolve_inputs

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
IMAGE_RECORD = {"messages": [
    {"role": "user", "content": [{"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": "x"}},
                                 {"type": "text", "text": "this picture?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}


# --- the stage: counting, truncation, subsets, output -----------------------------------------

def _conv(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


BAD_LINES = [
    json.dumps(_conv("Hi", "Hello!")),
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"messages": [{"role": "user", "content": "x"}]}),
    json.dumps(_conv("", "y")),
    json.dumps({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}),
    json.dumps(_conv("word " * 400, "y")),  # the answer starts after --max-len: nothing left to learn
    json.dumps(_conv("Tell me more.", "more words " * 100)),  # truncated, kept
]


def _prepare(target: Path, inputs: list[Path], output: Path, **kwargs) -> PrepareReport:
    return prepare(PrepareOptions(inputs=inputs, target=target, output=output, trust_remote_code=True, **kwargs))


@pytest.fixture(scope="module")
def bad_run(kimi_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    (folder / "bad.jsonl").write_text("\n".join(BAD_LINES) + "\n", encoding="utf-8")
    report = _prepare(kimi_target, [folder / "bad.jsonl"], folder / "prepared", max_len=128)
    return report, folder / "prepared"


def test_bad_input_is_skipped_and_counted(bad_run):
    report, _ = bad_run
    assert report.dropped == {"empty_content": 1, "malformed_record": 2, "no_assistant_turn": 1,
                              "no_supervised_after_truncation": 1, "non_string_content": 1, "unknown_role": 1}
    assert (report.samples_read, report.samples_kept, report.truncated) == (len(BAD_LINES), 2, 1)
    assert report.drop_examples["unknown_role"].endswith("bad.jsonl:4: role 'robot'")
    lines = warning_lines(report)
    assert len(lines) == len(report.dropped) and all(line.startswith("warning: ") for line in lines)
    assert any("skipped 2 sample(s): malformed_record" in line for line in lines)


AGENTIC_LINES = [
    json.dumps({"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need it.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},  # no id
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "14 C"},
        {"role": "assistant", "content": "14 °C.", "reasoning_content": "Report."}]}),
    json.dumps(IMAGE_RECORD),
    json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "oops"},
                                  {"from": "gpt", "value": "a"}]}),
]


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_report_counts_reasoning_tool_calls_media_and_skips(kind, request, tmp_path):
    path = tmp_path / "agentic.jsonl"
    path.write_text("\n".join(AGENTIC_LINES) + "\n", encoding="utf-8")
    report = _prepare(request.getfixturevalue(f"{kind}_target"), [path], tmp_path / "prepared")
    assert (report.samples_read, report.samples_kept, report.dropped) == (3, 3, {})  # nothing else is lost
    assert (report.supervised_turns, report.reasoning_turns, report.stripped_turns, report.tool_calls) == (4, 2, 0, 1)
    assert report.tool_calls_skipped == {"arguments_not_json": 1, "no_id": 1} and report.media_parts_dropped == 1
    assert report.tool_call_examples["no_id"] == f"{path}:1"
    # ChatML has no place for tool calls: said, not hidden.
    assert report.tool_calls_not_rendered == (kind == "flat")
    assert report.rendering["template_switches"] == ({"preserve_thinking": True} if kind == "kimi" else {})
    assert report.rendering["renders_tool_calls"] == (kind == "kimi")
    assert PrepareReport.load(tmp_path / "prepared") == report
    lines = warning_lines(report)
    assert any("skipped 1 malformed tool call(s): no_id" in line for line in lines)
    assert any("not in the text" in line for line in lines) == (kind == "flat")


def test_truncation_keeps_the_prefix(bad_run, kimi_target, maskers):
    report, folder = bad_run
    ds, _ = load_prepared(folder)
    long = ds[1]
    full = maskers["kimi"].encode(to_conversation("x", json.loads(BAD_LINES[-1])).messages)
    assert len(full.input_ids) > 128 and long["num_tokens"] == 128 == report.max_tokens
    assert long["input_ids"] == full.input_ids[:128] and long["loss_mask"] == full.loss_mask[:128]


def test_prepared_folder_matches_the_masker(demo_conversations, kimi_target, maskers, tmp_path):
    report = _prepare(kimi_target, [demo_conversations], tmp_path / "prepared", max_samples=40, seed=3)
    ds, loaded = load_prepared(tmp_path / "prepared")
    assert loaded == report and list(ds.column_names) == list(COLUMNS)
    assert len(ds) == report.samples_kept == 40 and report.not_selected == report.samples_read - 40
    conversations = [to_conversation(sid, record) for sid, record in iter_records(resolve_inputs([demo_conversations]))]
    by_id = {c.sample_id: c for c in conversations}
    for row in ds.select(range(5)):
        encoded = maskers["kimi"].encode(by_id[row["sample_id"]].messages)
        assert (row["input_ids"], row["loss_mask"]) == (encoded.input_ids, encoded.loss_mask)
        assert row["num_tokens"] == len(row["input_ids"])
    assert report.total_tokens == sum(ds["num_tokens"])
    assert report.supervised_tokens == sum(sum(m) for m in ds["loss_mask"])
    # Same seed, same subset, however many workers and chunks; another seed, another subset.
    again = _prepare(kimi_target, [demo_conversations], tmp_path / "again", max_samples=40, seed=3, num_proc=2,
                     chunk_size=16)
    assert load_prepared(tmp_path / "again")[0].to_dict() == ds.to_dict() and again.dropped == report.dropped
    _prepare(kimi_target, [demo_conversations], tmp_path / "other", max_samples=40, seed=4)
    assert load_prepared(tmp_path / "other")[0]["sample_id"] != ds["sample_id"]


def test_bad_flag_values(kimi_target, demo_conversations, tmp_path):
    for flag, kwargs in (("--max-len", {"max_len": 0}), ("--num-proc", {"num_proc": 0}),
                         ("--max-samples", {"max_samples": 0}), ("--chunk-size", {"chunk_size": 0})):
        with pytest.raises(PipelineError, match=flag):
            _prepare(kimi_target, [demo_conversations], tmp_path / "out", **kwargs)


def test_demo_agentic_data_is_clean_and_agentic(demo_conversations):
    """Every call well formed and answered, contents plain strings (renderable by any template), and
    a realistic share of tool use and reasoning."""
    lines = (demo_conversations.parent / "demo_agentic.jsonl").read_text(encoding="utf-8").splitlines()
    conversations = [to_conversation(str(i), json.loads(line)) for i, line in enumerate(lines)]
    assert all(isinstance(c, Conversation) and not c.skipped_tool_calls for c in conversations)
    assert all(isinstance(m["content"], str) for line in lines for m in json.loads(line)["messages"])
    with_tools = [c for c in conversations if any(m.tool_calls for m in c.messages)]
    for c in with_tools:
        calls = [call.id for m in c.messages for call in m.tool_calls]
        assert [m.tool_call_id for m in c.messages if m.role == "tool"] == calls
        assert {call.name for m in c.messages for call in m.tool_calls} <= {t["function"]["name"] for t in c.tools}
    assert 0.4 <= len(with_tools) / len(conversations) <= 0.7
    assert all(any(m.reasoning for m in c.messages) for c in conversations)


def test_qwen3s_template_keeps_every_tool_calling_conversation(flat_target, demo_conversations, tmp_path):
    """The demo's agentic data under Qwen3's own chat template (tests/data/): its tool-call turns
    have empty content, which the template tests for; every conversation is kept and every call
    supervised. The reasoning the template drops (turns before the last user message) is counted."""
    target = tmp_path / "qwen3-template"
    target.mkdir()
    for f in flat_target.iterdir():
        if f.suffix == ".safetensors":
            (target / f.name).symlink_to(f)
        else:
            shutil.copy(f, target / f.name)
    shutil.copy(REPO_ROOT / "tests" / "data" / "qwen3_chat_template.jinja", target / "chat_template.jinja")
    report = _prepare(target, [demo_conversations.parent / "demo_agentic.jsonl"], tmp_path / "prepared")
    assert (report.samples_read, report.samples_kept, report.dropped) == (180, 180, {})
    assert (report.tool_calls, report.tool_calls_not_rendered, report.unlocated_turns) == (123, 0, 0)
    assert (report.supervised_turns, report.reasoning_turns, report.stripped_turns) == (275, 270, 71)
    assert warning_lines(report) == ["warning: 71 assistant turn(s) not supervised: the chat template drops their "
                                     "reasoning (an emptied think block is not what the model generated)"]


# --- the script --------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_writes_folder_and_report(kimi_target, demo_conversations, tmp_path):
    out = tmp_path / "run" / "prepared"
    proc = run_script("01_prepare_data.py", "--input", demo_conversations, "--target", kimi_target,
                      "--trust-remote-code", "--run-dir", tmp_path / "run", "--max-len", "256")
    ds, report = load_prepared(out)
    assert report.samples_read == report.samples_kept + sum(report.dropped.values()) + report.not_selected == 400
    assert report.samples_kept == len(ds) and report.max_tokens <= 256 == report.max_len
    assert sum(n == 256 for n in ds["num_tokens"]) >= report.truncated > 0
    assert 0 < report.supervised_share < 1 and report.chat_template_sha256 and report.tokenizer == "TikTokenTokenizer"
    assert all(max(ids) < report.vocab_size for ids in ds["input_ids"])
    for line in summary_lines(report, out):
        assert line in proc.stdout
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]  # the resume folder removed


@pytest.mark.slow
@pytest.mark.parametrize("make, reason", [
    (lambda d: d / "missing.jsonl", "no such file"),
    (lambda d: (d / "chats.txt").write_text("x") and d / "chats.txt", "unknown format"),
    (lambda d: (d / "junk.jsonl").write_text("{bad\n[1]\n") and d / "junk.jsonl", "no usable conversation"),
])
def test_cli_errors_name_the_file(kimi_target, tmp_path, make, reason):
    path = make(tmp_path)
    proc = run_in_process("01_prepare_data.py", "--input", path, "--target", kimi_target, "--trust-remote-code",
                          "--output", tmp_path / "out")
    assert proc.returncode == 1
    assert "error: " in proc.stderr and str(path) in proc.stderr and reason in proc.stderr
    assert not (tmp_path / "out").exists()


def _interrupted(args: list, work: Path, sig: signal.Signals, chunks: int = 2) -> subprocess.CompletedProcess:
    """01 with `args`, sent `sig` once `chunks` chunks are tokenized (its journal in `work`)."""
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "01_prepare_data.py"), *map(str, args)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    journals = lambda: list(work.glob("*/encoded.json"))  # noqa: E731
    while not (journals() and len(json.loads(journals()[0].read_text())) >= chunks):
        assert proc.poll() is None, f"01 ended before it was interrupted:\n{proc.stderr.read()}"
        assert time.monotonic() < deadline, "01 tokenized no chunk in 300 s"
        time.sleep(0.02)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_interrupted_run_resumes_its_finished_chunks(kimi_target, demo_conversations, tmp_path):
    """SIGKILL after 2 of 40 chunks: the same command reuses what was read and the finished chunks
    and writes what an uninterrupted run writes; with the input changed it starts over."""
    inputs = tmp_path / "many.jsonl"
    inputs.write_text(demo_conversations.read_text(encoding="utf-8") * 4, encoding="utf-8")  # 1,600
    out = tmp_path / "run" / "prepared"
    args = ["--input", inputs, "--target", kimi_target, "--trust-remote-code", "--output", out, "--max-len", "256",
            "--chunk-size", "40"]  # 40 chunks: most are left when the signal comes
    work = out.parent / ".tmp-prepared.resume"
    killed = _interrupted(args, work, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL and not out.exists()
    proc = run_script("01_prepare_data.py", *args)
    resumed = re.search(r"resuming: (\d+) of 40 chunks", proc.stdout + proc.stderr)
    assert "resuming: the 1,600 conversations read before" in proc.stdout + proc.stderr and resumed
    assert int(resumed.group(1)) >= 2 and not work.exists()

    expected = _prepare(kimi_target, [inputs], tmp_path / "reference" / "prepared", max_len=256)
    (ds, report), (ref, ref_report) = load_prepared(out), load_prepared(tmp_path / "reference" / "prepared")
    assert ds.to_dict() == ref.to_dict() and asdict(report) == asdict(ref_report) == asdict(expected)

    terminated = _interrupted(args, work, signal.SIGTERM)
    assert terminated.returncode == 143 and "terminated: finished files are kept" in terminated.stderr
    with inputs.open("a", encoding="utf-8") as f:
        f.write(json.dumps(_conv("One more question?", "One more answer.")) + "\n")
    proc = run_script("01_prepare_data.py", *args)
    assert "resuming" not in proc.stdout + proc.stderr and not work.exists()
    assert load_prepared(out)[1].samples_read == 1601
