"""Step 01's work: conversations -> tokenized samples with loss masks, and their report.

read (all inputs, validated, bad records counted) -> optional deterministic subset
(`--max-samples`, `--seed`) -> render + tokenize + mask (`datasets.map`, `--num-proc`
workers, `--chunk-size` conversations at a time) -> truncate at `--max-len` -> the prepared folder
of `common.prepare.prepared_dataset`, written atomically. Intermediate Arrow files live in a work
folder next to the output (`.tmp-NAME.resume/`), so memory stays flat for 500K conversations.

Resume: the work folder outlives an interrupted run (Ctrl-C, SIGTERM, SIGKILL, a full disk). It
keeps what was read once reading is complete, and each tokenized chunk once its file is complete
(datasets writes a temporary file and renames it), under a key of everything the result depends
on (the inputs' sizes and modification times, the flags but `--num-proc`, the tokenizer and its
template, this format); the same command run again reuses them and tokenizes the rest. Another
key starts over. The work folder is removed once the prepared folder is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
from datasets import Dataset, Features, List, Value, concatenate_datasets
from datasets.exceptions import DatasetGenerationError
from tqdm import tqdm

from common.atomic import TMP_PREFIX, write_dir, write_error, write_json
from common.errors import PipelineError
from common.prepare.conversations import (
    Conversation,
    Message,
    Rejection,
    ToolCall,
    to_conversation,
)
from common.prepare.loss_mask import NO_SUPERVISED_TOKENS, ChatMasker, MaskError, template_sha256
from common.prepare.prepared_dataset import COLUMNS, PrepareReport
from common.prepare.readers import iter_records, resolve_inputs
from common.target.config import load_target_info, target_digest
from common.target.tokenizer import load_tokenizer

__all__ = ["PrepareOptions", "DropLog", "prepare", "summary_lines", "warning_lines"]

NO_SUPERVISED_AFTER_TRUNCATION = "no_supervised_after_truncation"
BATCH_SIZE = 256
CHUNK_SIZE = 10_000  # conversations tokenized per resumable unit (a minute of one process at most)
RESUME_FORMAT = 2  # of the work folder; a change in what it keeps starts interrupted runs over
# What reading adds to the report and the drop log, kept with what was read.
READ_FIELDS = ("samples_read", "media_parts_dropped", "tool_calls_skipped", "tool_call_examples")
# A conversation read is kept as one JSON string (`_row`): Arrow's nested columns cost more to
# write and to turn back into Python than the JSON does, a tenth of the stage's time.
CONVERSATION_FEATURES = Features({"sample_id": Value("string"), "conversation": Value("string")})
# Per-sample counts of what the supervised turns hold, summed into the report.
TURN_COUNTS = ("supervised_turns", "reasoning_turns", "stripped_turns", "tool_calls", "tool_calls_not_rendered",
               "unlocated_turns")
# The prepared columns, then per-sample bookkeeping that `_account` reads and drops.
ENCODED_FEATURES = Features({
    "sample_id": Value("string"), "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
    "num_tokens": Value("int32"), "num_supervised": Value("int32"), "truncated": Value("bool"),
    "drop_reason": Value("string"), "drop_detail": Value("string"), **{name: Value("int32") for name in TURN_COUNTS},
})


@dataclass(frozen=True)
class PrepareOptions:
    inputs: list[Path]
    target: Path
    output: Path
    max_len: int = 2048
    max_samples: int | None = None
    seed: int = 0
    num_proc: int = 1
    trust_remote_code: bool = False
    chunk_size: int = CHUNK_SIZE

    def check(self) -> None:
        """Reject bad flag values, naming the flag."""
        for flag, value in (("--max-len", self.max_len), ("--num-proc", self.num_proc),
                            ("--max-samples", self.max_samples), ("--chunk-size", self.chunk_size)):
            if value is not None and value < 1:
                raise PipelineError(f"{flag} {value}: must be at least 1")


@dataclass
class DropLog:
    """Skipped samples by reason, with the first one of each for the warning."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, sample_id: str, detail: str) -> None:
        self.counts[reason] += 1
        self.examples.setdefault(reason, f"{sample_id}: {detail}")


def prepare(options: PrepareOptions) -> PrepareReport:
    """Run the whole stage and write `options.output`; returns the report written there."""
    options.check()
    sources = resolve_inputs(options.inputs)  # fail on a missing file before loading anything
    info = load_target_info(options.target, options.trust_remote_code)
    tokenizer = load_tokenizer(options.target, options.trust_remote_code)
    masker = ChatMasker(tokenizer)
    report = PrepareReport(target=info.path, tokenizer=type(tokenizer).__name__, vocab_size=info.vocab_size,
                           chat_template_sha256=template_sha256(tokenizer), max_len=options.max_len,
                           inputs=[str(p) for p in options.inputs], max_samples=options.max_samples,
                           seed=options.seed, rendering=masker.describe(), target_digest=target_digest(info.path))
    drops = DropLog()
    work = _work_folder(options, sources, report)
    try:
        conversations = _read(sources, work, report, drops)
        conversations = _subset(conversations, options, report)
        with _naming_write_errors(work):
            encoded = _encode(conversations, masker, options, work)
        kept = _account(encoded, report, drops)
        if report.samples_kept == 0:
            raise PipelineError(_nothing_usable(report, drops))
        with _naming_write_errors(options.output):
            write_dir(options.output, lambda tmp: _save(kept, report, tmp, options.num_proc))
    except PipelineError as e:
        if not isinstance(e.__cause__, OSError):  # bad input: nothing to resume (a full disk: the rerun's)
            shutil.rmtree(work.parent, ignore_errors=True)
        raise
    shutil.rmtree(work.parent, ignore_errors=True)
    return report


# --- resume ---------------------------------------------------------------------------------

def _work_folder(options: PrepareOptions, sources, report: PrepareReport) -> Path:
    """`.tmp-NAME.resume/KEY/` next to the output: an interrupted run's, if it had the same key;
    any other key's work is removed."""
    stamp = {"format": RESUME_FORMAT, "inputs": [[str(p.resolve()), fmt, _file_stamps(p)] for p, fmt in sources],
             "max_len": options.max_len, "max_samples": options.max_samples, "seed": options.seed,
             "chunk_size": options.chunk_size, "target": report.target_digest,
             "template": report.chat_template_sha256, "rendering": report.rendering}
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = options.output.parent / f"{TMP_PREFIX}{options.output.name}.resume"
    if root.is_dir():
        for other in root.iterdir():
            if other.name != key:
                shutil.rmtree(other, ignore_errors=True)
    (root / key).mkdir(parents=True, exist_ok=True)
    return root / key


def _file_stamps(path: Path) -> list:
    """(name, size, modification time) of an input file, or of every file in an input folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.relative_to(path)) if path.is_dir() else "", st.st_size, st.st_mtime_ns]
            for p in files for st in (p.stat(),)]


def _kept_files(work: Path, names: list[str]) -> Dataset | None:
    """The dataset of Arrow files a run kept in `work`, or None if one is missing."""
    if not names or not all((work / name).is_file() for name in names):
        return None
    parts = [Dataset.from_file(str(work / name)) for name in names]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _kept_names(dataset: Dataset, work: Path) -> list[str]:
    return [str(Path(f["filename"]).resolve().relative_to(work.resolve())) for f in dataset.cache_files]


# --- stages ---------------------------------------------------------------------------------

def _generate(sources, report: PrepareReport, drops: DropLog):
    for sample_id, record in tqdm(iter_records(sources), desc="read", unit=" conv", mininterval=1.0):
        report.samples_read += 1
        item = to_conversation(sample_id, record)
        if isinstance(item, Rejection):
            drops.add(item.reason, sample_id, item.detail)
            continue
        report.media_parts_dropped += item.media_parts
        for reason in item.skipped_tool_calls:
            report.tool_calls_skipped[reason] = report.tool_calls_skipped.get(reason, 0) + 1
            report.tool_call_examples.setdefault(reason, sample_id)
        yield _row(item)


def _row(conversation: Conversation) -> dict:
    """The conversation as a row of CONVERSATION_FEATURES: its tools and its messages' fields."""
    messages = [[m.role, m.content, m.reasoning, m.name, m.tool_call_id,
                 [[c.id, c.name, c.arguments, c.arguments_is_object] for c in m.tool_calls]]
                for m in conversation.messages]
    return {"sample_id": conversation.sample_id,
            "conversation": json.dumps([conversation.tools, messages], ensure_ascii=False)}


def _unrow(conversation: str) -> tuple[list[Message], list | None]:
    """The inverse of `_row`: (messages, tools)."""
    tools, messages = json.loads(conversation)
    return [Message(role, content, reasoning, name=name, tool_call_id=call_id,
                    tool_calls=tuple(ToolCall(*c) for c in calls))
            for role, content, reasoning, name, call_id, calls in messages], tools


def _read(sources, work: Path, report: PrepareReport, drops: DropLog) -> Dataset:
    """Validated conversations as an Arrow-backed dataset in `work`: an interrupted run's once it
    had read everything (with its counts), or read now."""
    journal = work / "read.json"
    if journal.is_file():
        state = json.loads(journal.read_text())
        kept = _kept_files(work, state["files"])
        if kept is not None:
            for name in READ_FIELDS:
                setattr(report, name, state["report"][name])
            drops.counts.update(state["drops"]["counts"])
            drops.examples.update(state["drops"]["examples"])
            tqdm.write(f"resuming: the {report.samples_read:,} conversations read before, kept in {work}")
            return kept
    shutil.rmtree(work / "read", ignore_errors=True)  # an interrupted read starts over
    conversations = _read_now(sources, work, report, drops)
    write_json(journal, {"files": _kept_names(conversations, work),
                         "report": {name: getattr(report, name) for name in READ_FIELDS},
                         "drops": {"counts": dict(drops.counts), "examples": drops.examples}})
    return conversations


def _read_now(sources, work: Path, report: PrepareReport, drops: DropLog) -> Dataset:
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the reader shows its own bar
    try:
        return Dataset.from_generator(_generate, features=CONVERSATION_FEATURES, cache_dir=str(work / "read"),
                                      gen_kwargs={"sources": sources, "report": report, "drops": drops})
    except DatasetGenerationError as e:
        if isinstance(e.__cause__, PipelineError):
            raise e.__cause__ from None
        if isinstance(e.__cause__, OSError):  # writing the Arrow files of what was read (a full disk)
            raise PipelineError(write_error(e.__cause__, work)) from e.__cause__
        raise
    except ValueError as e:
        if sum(drops.counts.values()) == report.samples_read:  # datasets refuses an empty split
            raise PipelineError(_nothing_usable(report, drops)) from e
        raise
    finally:
        if bars:
            datasets.enable_progress_bars()


@contextmanager
def _naming_write_errors(folder: Path) -> Iterator[None]:
    """A failed write in `folder` (datasets and Arrow raise OSError without a path: "[Errno 28]
    No space left on device") as one line naming the folder and the cause."""
    try:
        yield
    except OSError as e:
        raise PipelineError(write_error(e, folder)) from e


def _subset(conversations: Dataset, options: PrepareOptions, report: PrepareReport) -> Dataset:
    """A deterministic random subset of `--max-samples` conversations (kept in input order)."""
    n = options.max_samples
    if n is None or n >= len(conversations):
        return conversations
    chosen = np.sort(np.random.default_rng(options.seed).choice(len(conversations), size=n, replace=False))
    report.not_selected = len(conversations) - n
    return conversations.select(chosen)


def _encode_batch(batch: dict, masker: ChatMasker, max_len: int) -> dict:
    """Rows of ENCODED_FEATURES; the ids and masks as numpy arrays, which Arrow takes whole (from
    Python lists it converts one int at a time, a tenth of the stage's time)."""
    out = {name: [] for name in ENCODED_FEATURES}
    empty_ids, empty_mask = np.zeros(0, np.int32), np.zeros(0, np.int8)
    for sample_id, conversation in zip(batch["sample_id"], batch["conversation"]):
        ids, mask, truncated, reason, detail, counts = empty_ids, empty_mask, False, "", "", dict.fromkeys(TURN_COUNTS, 0)
        try:
            encoded = masker.encode(*_unrow(conversation))
            ids, mask, r = encoded.ids, encoded.mask, encoded.rendering
            counts = {"supervised_turns": len(r.spans), "reasoning_turns": r.reasoning_turns,
                      "stripped_turns": r.stripped_turns, "tool_calls": r.tool_calls,
                      "tool_calls_not_rendered": r.tool_calls_not_rendered, "unlocated_turns": r.unlocated_turns}
            if not mask.any():
                raise MaskError(NO_SUPERVISED_TOKENS, "the template renders no assistant turn")
            if len(ids) > max_len:
                truncated, ids, mask = True, ids[:max_len], mask[:max_len]
                if not mask.any():
                    raise MaskError(NO_SUPERVISED_AFTER_TRUNCATION,
                                    f"no assistant token in the first {max_len} tokens")
        except MaskError as e:
            ids, mask, reason, detail = empty_ids, empty_mask, e.reason, e.detail
        row = {"sample_id": sample_id, "input_ids": ids, "loss_mask": mask, "num_tokens": len(ids),
               "num_supervised": int(mask.sum(dtype=np.int64)), "truncated": truncated, "drop_reason": reason,
               "drop_detail": detail, **counts}
        for name, value in row.items():
            out[name].append(value)
    return out


def _encode(conversations: Dataset, masker: ChatMasker, options: PrepareOptions, work: Path) -> Dataset:
    """`_encode_batch` over all conversations, `--chunk-size` at a time; the chunks an interrupted
    run finished (`encoded.json`) are reused."""
    journal = work / "encoded.json"
    done: dict[str, list[str]] = json.loads(journal.read_text()) if journal.is_file() else {}
    bounds = list(range(0, len(conversations), options.chunk_size))
    reused = {i: kept for i in range(len(bounds)) if (kept := _kept_files(work, done.get(str(i), []))) is not None}
    if reused:
        tqdm.write(f"resuming: {len(reused):,} of {len(bounds):,} chunks of {options.chunk_size:,} conversations "
                   f"tokenized before, kept in {work}")
    parts = []
    for i, start in enumerate(bounds):
        kept = reused.get(i)
        if kept is None:
            chunk = conversations.select(range(start, min(start + options.chunk_size, len(conversations))))
            kept = _encode_chunk(chunk, masker, options, work / f"encoded-{i:05d}.arrow",
                                 "tokenize" if len(bounds) == 1 else f"tokenize {i + 1}/{len(bounds)}")
            done[str(i)] = _kept_names(kept, work)
            write_json(journal, done)
        parts.append(kept)
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _encode_chunk(chunk: Dataset, masker: ChatMasker, options: PrepareOptions, file: Path, desc: str) -> Dataset:
    # An explicit fingerprint spares datasets from hashing the tokenizer; its own cache is not
    # consulted (the journal is), and it writes `file` under a temporary name first.
    fingerprint = hashlib.sha256(f"{file.name}:{len(chunk)}:{options}".encode()).hexdigest()[:16]
    return chunk.map(
        _encode_batch, batched=True, batch_size=BATCH_SIZE, num_proc=options.num_proc if options.num_proc > 1 else None,
        fn_kwargs={"masker": masker, "max_len": options.max_len}, remove_columns=chunk.column_names,
        features=ENCODED_FEATURES, new_fingerprint=fingerprint, cache_file_name=str(file),
        load_from_cache_file=False, desc=desc)


def _account(encoded: Dataset, report: PrepareReport, drops: DropLog) -> Dataset:
    """Fill the report's counts and token statistics; return the kept samples."""
    stats = encoded.select_columns(["num_tokens", "num_supervised", "truncated", "drop_reason", *TURN_COUNTS]
                                   ).with_format("numpy")[:]
    reasons = stats["drop_reason"].astype(str)
    dropped = np.flatnonzero(reasons != "")
    if len(dropped):
        details = encoded.select(dropped).select_columns(["sample_id", "drop_reason", "drop_detail"])
        for sample_id, reason, detail in zip(details["sample_id"], details["drop_reason"], details["drop_detail"]):
            drops.add(reason, sample_id, detail)
    keep = np.flatnonzero(reasons == "")
    tokens, supervised = stats["num_tokens"][keep].astype(np.int64), stats["num_supervised"][keep].astype(np.int64)
    report.samples_kept = len(keep)
    report.dropped = dict(sorted(drops.counts.items()))
    report.drop_examples = {r: drops.examples[r] for r in report.dropped}
    report.truncated = int(stats["truncated"][keep].sum())
    for name in TURN_COUNTS:
        setattr(report, name, int(stats[name][keep].sum()))
    report.tool_calls_skipped = dict(sorted(report.tool_calls_skipped.items()))
    if len(keep):
        report.total_tokens, report.supervised_tokens = int(tokens.sum()), int(supervised.sum())
        report.min_tokens, report.max_tokens = int(tokens.min()), int(tokens.max())
        report.mean_tokens = round(float(tokens.mean()), 2)
        report.supervised_share = round(report.supervised_tokens / report.total_tokens, 4)
    return encoded.select(keep).select_columns(list(COLUMNS))


def _save(kept: Dataset, report: PrepareReport, folder: Path, num_proc: int) -> None:
    kept.save_to_disk(str(folder), num_proc=num_proc if num_proc > 1 else None)
    report.save(folder)


# --- messages -------------------------------------------------------------------------------

def _nothing_usable(report: PrepareReport, drops: DropLog) -> str:
    reasons = ", ".join(f"{reason} {count:,} (e.g. {drops.examples[reason]})"
                        for reason, count in sorted(drops.counts.items())) or "the inputs hold no records"
    return f"{', '.join(report.inputs)}: no usable conversation in {report.samples_read:,} read; dropped: {reasons}"


def warning_lines(report: PrepareReport) -> list[str]:
    """One line per drop reason (not per sample)."""
    lines = [f"warning: skipped {count:,} sample(s): {reason}, e.g. {report.drop_examples[reason]}"
             for reason, count in report.dropped.items()]
    lines += [f"warning: skipped {count:,} malformed tool call(s): {reason}, e.g. in {report.tool_call_examples[reason]} "
              "(the rest of the conversation is kept)" for reason, count in report.tool_calls_skipped.items()]
    if report.stripped_turns:
        lines.append(f"warning: {report.stripped_turns:,} assistant turn(s) not supervised: the chat template drops "
                     "their reasoning (an emptied think block is not what the model generated)")
    if report.unlocated_turns:
        lines.append(f"warning: {report.unlocated_turns:,} assistant turn(s) not supervised: nothing of theirs can be "
                     "located in the rendering (empty content, no reasoning, and tool calls the chat template "
                     "renders from objects)")
    if report.tool_calls_not_rendered:
        lines.append(f"warning: {report.tool_calls_not_rendered:,} tool call(s) of supervised turns are not in the "
                     "text: the chat template does not render tool calls")
    return lines


def summary_lines(report: PrepareReport, output: Path) -> list[str]:
    dropped = sum(report.dropped.values())
    lines = [f"read {report.samples_read:,} conversations: kept {report.samples_kept:,}, dropped {dropped:,}"
             + (f", left out by --max-samples {report.not_selected:,}" if report.not_selected else "")]
    lines += [f"  dropped {count:,}: {reason}" for reason, count in report.dropped.items()]
    lines += [f"truncated at {report.max_len:,} tokens: {report.truncated:,}",
              f"tokens: {report.total_tokens:,} (min {report.min_tokens:,}, mean {report.mean_tokens:,.1f}, "
              f"max {report.max_tokens:,}), supervised {report.supervised_tokens:,} "
              f"({report.supervised_share:.1%})",
              f"assistant turns supervised: {report.supervised_turns:,} ({report.reasoning_turns:,} with reasoning, "
              f"{report.tool_calls:,} tool calls); not supervised, reasoning dropped by the template: "
              f"{report.stripped_turns:,}; media parts dropped: {report.media_parts_dropped:,}",
              f"wrote {output}"]
    return lines
