"""Step 00's work: conversations -> the same conversations with the target's own answers.

Every assistant turn is replaced by what the target generates after the chat template's
generation prompt (thinking mode unless `thinking=False`), given the conversation so far; system,
user, tool declarations and tool results are kept. Later turns see the REGENERATED history: that
is what the target would have seen had it held the conversation, and what the draft meets when it
serves. The prompt is rendered with the template's defaults, as at inference (Kimi: earlier
turns' reasoning dropped); the output keeps every turn's reasoning for 01 to supervise.

Tool results cannot be re-run: an original result is kept only when the regenerated turn calls
the same functions in the same order (the result is re-keyed to the new call id). When the target
calls other functions, or none where the original called some (or the reverse), the conversation
ends with that regenerated turn (`ended_early.tool_calls_diverged`). A turn that cannot be
regenerated (prompt too long, generation cut at the token limit, unparsable tool calls, empty
answer) ends the conversation before it when an earlier turn was regenerated, else drops the
conversation (counted by reason); `keep_too_long` keeps such a conversation as is instead, and
`keep_cut` keeps a cut generation as the conversation's last turn.

Output folder: `shard-J-of-K-part-C.jsonl` files in OpenAI form (one per `part_size` input
records of shard J; host J of K takes records i with i % K == J), each written atomically once
its part is done; `.journal/` (hidden, so 01 reading the folder skips it) holds each part's
counts, written before the part's data file, and the settings, so a resumed run (the same
command) skips finished parts, regenerates nothing twice and loses nothing, and refuses
different settings. The report `regenerate_report.json` (per host `..._shard-J-of-K_report.json`)
sums the parts.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from common.atomic import atomic_path, read_json, remove_stale_temporaries, write_json
from common.errors import PipelineError
from common.prepare.conversations import Conversation, Message, Rejection, to_conversation
from common.prepare.loss_mask import INSTANT_MODE
from common.prepare.readers import iter_records, resolve_inputs
from common.regenerate.assistant_output import THINK_OPEN, MalformedToolCall, parse_assistant_text

__all__ = [
    "RegenerateOptions", "Completion", "Engine", "regenerate", "part_name",
    "report_name", "summary_lines", "JOURNAL_DIR", "TurnRegenerator", "PartStats",
]

JOURNAL_DIR = ".journal"
PART_FORMAT = "shard-{shard:03d}-of-{shards:03d}-part-{part:06d}"
# Why a turn could not be regenerated (report keys).
PROMPT_TOO_LONG = "prompt_too_long"
GENERATION_CUT = "generation_cut"
MALFORMED_TOOL_CALL = "malformed_tool_call"
EMPTY_ANSWER = "empty_answer"
TOOL_CALLS_DIVERGED = "tool_calls_diverged"
# Settings that change what is generated: a resumed run must use the same.
RESUME_KEYS = ("inputs", "target", "max_new_tokens", "temperature", "top_p", "seed", "max_samples", "num_shards",
               "shard_index", "part_size", "max_prompt_len", "thinking", "keep_cut", "keep_too_long")


@dataclass(frozen=True)
class RegenerateOptions:
    inputs: list[Path]
    target: Path
    output: Path
    temperature: float
    top_p: float
    max_new_tokens: int = 1024
    seed: int = 0
    max_samples: int | None = None
    num_shards: int = 1
    shard_index: int = 0
    part_size: int = 256
    batch_size: int = 8
    max_prompt_len: int = 4096
    thinking: bool = True
    keep_cut: bool = False
    keep_too_long: bool = False
    engine: str = "hf"

    def check(self) -> None:
        """Reject bad flag values, naming the flag."""
        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--max-samples", self.max_samples),
                            ("--num-shards", self.num_shards), ("--part-size", self.part_size),
                            ("--batch-size", self.batch_size), ("--max-prompt-len", self.max_prompt_len)):
            if value is not None and value < 1:
                raise PipelineError(f"{flag} {value}: must be at least 1")
        if not 0 <= self.shard_index < self.num_shards:
            raise PipelineError(f"--shard-index {self.shard_index}: must be in [0, --num-shards {self.num_shards})")
        if not 0.0 <= self.temperature <= 100.0:
            raise PipelineError(f"--temperature {self.temperature}: must be in [0, 100] (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise PipelineError(f"--top-p {self.top_p}: must be in (0, 1]")

    def settings(self) -> dict[str, Any]:
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        out["inputs"] = [str(p) for p in self.inputs]
        return out


# --- engines ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # generated ids, the stop token excluded
    finished: bool  # ended with a stop token (False: cut at the token limit)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]: ...


# --- one conversation, turn by turn -----------------------------------------------------------

@dataclass
class PartStats:
    """Counts of one part (the journal's record); the report sums them."""

    records: int = 0
    regenerated: int = 0
    kept_as_is: int = 0
    dropped: Counter = field(default_factory=Counter)
    ended_early: Counter = field(default_factory=Counter)
    turns: int = 0
    generations: int = 0
    generations_cut: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: PartStats) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def to_json(self) -> dict:
        # not asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs
        return {**vars(self), "dropped": dict(self.dropped), "ended_early": dict(self.ended_early)}

    @classmethod
    def from_json(cls, data: dict) -> PartStats:
        return cls(**{**data, "dropped": Counter(data["dropped"]), "ended_early": Counter(data["ended_early"])})


@dataclass
class _Turns:
    """A conversation being regenerated: the original, the output so far, where the next original
    message is, and the old -> new tool call ids of kept tool results."""

    original: Conversation
    messages: list[Message] = field(default_factory=list)
    position: int = 0
    id_map: dict[str, str] = field(default_factory=dict)
    turns: int = 0
    outcome: str | None = None  # "regenerated", "kept_as_is" or a drop reason; None while running
    early: str | None = None  # why a regenerated conversation ended before its original did

    def next_prompt(self) -> list[Message] | None:
        """Copy the original messages up to the next assistant turn; the history to generate
        from, or None when no assistant turn is left (the conversation is finished)."""
        originals = self.original.messages
        while self.position < len(originals) and originals[self.position].role != "assistant":
            m = originals[self.position]
            if m.role == "tool" and m.tool_call_id in self.id_map:
                m = Message("tool", m.content, tool_call_id=self.id_map[m.tool_call_id])
            self.messages.append(m)
            self.position += 1
        if self.position == len(originals):
            self.end()
            return None
        return self.messages

    def accept(self, message: Message) -> None:
        """The regenerated assistant turn; the conversation ends here when its tool calls differ
        from the original turn's (the original results would answer other calls)."""
        old = self.original.messages[self.position]
        self.messages.append(message)
        self.turns += 1
        self.position += 1
        if [c.name for c in old.tool_calls] != [c.name for c in message.tool_calls]:
            self.end(TOOL_CALLS_DIVERGED)
        else:
            self.id_map.update({a.id: b.id for a, b in zip(old.tool_calls, message.tool_calls)})

    def fail(self, reason: str, keep_as_is: bool = False) -> None:
        if self.turns:
            self.end(reason)
        else:
            self.outcome = "kept_as_is" if keep_as_is else reason

    def end(self, early: str | None = None) -> None:
        """Finished: the output ends with its last regenerated assistant turn."""
        last = max(i for i, m in enumerate(self.messages) if m.role == "assistant") if self.turns else -1
        del self.messages[last + 1:]
        self.outcome = "regenerated" if self.turns else "no_assistant_turn"
        self.early = early

    def record(self) -> dict:
        messages = self.original.messages if self.outcome == "kept_as_is" else self.messages
        out: dict[str, Any] = {"id": self.original.sample_id, "messages": [m.to_template() for m in messages]}
        if self.original.tools:
            out["tools"] = self.original.tools
        return out


class TurnRegenerator:
    """Renders prompts with the target's tokenizer, asks the engine, reads the answers back."""

    def __init__(self, tokenizer, engine: Engine, options: RegenerateOptions):
        self.tokenizer, self.engine, self.options = tokenizer, engine, options
        self.variables = {} if options.thinking else dict(INSTANT_MODE)
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                              add_generation_prompt=True, **self.variables)
        self.starts_in_thinking = probe.endswith(THINK_OPEN)

    def prompt_ids(self, state: _Turns, history: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template([m.to_template() for m in history], tools=state.original.tools,
                                                  tokenize=False, add_generation_prompt=True, **self.variables)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def run(self, conversations: list[Conversation], stats: PartStats, seed: int, on_done) -> list[_Turns]:
        """Regenerate the conversations round by round (round r: the r-th assistant turn of every
        conversation still running, in one engine call)."""
        states = [_Turns(c) for c in conversations]
        running = states
        for round_index in itertools.count():
            waiting = []
            for state in running:
                history = state.next_prompt()
                if history is None:
                    on_done(state)
                    continue
                ids = self.prompt_ids(state, history)
                if len(ids) > self.options.max_prompt_len:
                    state.fail(PROMPT_TOO_LONG, keep_as_is=self.options.keep_too_long)
                    on_done(state)
                else:
                    waiting.append((state, ids))
            if not waiting:
                return states
            completions = self.engine.generate([ids for _, ids in waiting], self.options.max_new_tokens,
                                               seed * 1_000_003 + round_index)
            running = []
            for (state, ids), completion in zip(waiting, completions):
                stats.generations += 1
                stats.prompt_tokens += len(ids)
                stats.generated_tokens += len(completion.tokens) + completion.finished
                if self._apply(state, completion, stats):
                    running.append(state)
                else:
                    on_done(state)
        raise AssertionError("unreachable")

    def _apply(self, state: _Turns, completion: Completion, stats: PartStats) -> bool:
        """Read one generation into the conversation; False when the conversation is finished."""
        text = self.tokenizer.decode(completion.tokens, skip_special_tokens=False)
        stats.generations_cut += not completion.finished
        try:
            parsed = parse_assistant_text(text, self.starts_in_thinking)
        except MalformedToolCall:
            if completion.finished:
                state.fail(MALFORMED_TOOL_CALL)
                return False
            parsed = None  # a call cut in the middle
        answered = parsed is not None and parsed.closed_thinking and (
            parsed.message.content.strip() or parsed.message.tool_calls)
        if not completion.finished and not (self.options.keep_cut and answered):
            state.fail(GENERATION_CUT)
            return False
        if not answered:
            state.fail(EMPTY_ANSWER)
            return False
        stats.tool_calls += len(parsed.message.tool_calls)
        state.accept(parsed.message)
        if not completion.finished:
            state.end(GENERATION_CUT)  # kept (keep_cut): nothing can follow a cut turn
        return state.outcome is None


# --- parts, journal, report -------------------------------------------------------------------

def part_name(shard_index: int, num_shards: int, part: int) -> str:
    return PART_FORMAT.format(shard=shard_index, shards=num_shards, part=part)


def report_name(shard_index: int, num_shards: int) -> str:
    """`regenerate_report.json`, or per host of several. 01 reading the folder skips `*_report.json`."""
    if num_shards == 1:
        return "regenerate_report.json"
    return f"regenerate_shard-{shard_index:03d}-of-{num_shards:03d}_report.json"


def _host_parts(options: RegenerateOptions) -> Iterator[tuple[int, list[tuple[str, Any]]]]:
    """(part index, its records) of this host: records i with i % num_shards == shard_index,
    `part_size` of them per part, in input order."""
    part, records = 0, []
    for i, record in enumerate(iter_records(resolve_inputs(options.inputs))):
        if options.max_samples is not None and i >= options.max_samples:
            break
        if i % options.num_shards != options.shard_index:
            continue
        records.append(record)
        if len(records) == options.part_size:
            yield part, records
            part, records = part + 1, []
    if records:
        yield part, records


def _check_settings(journal: Path, options: RegenerateOptions) -> None:
    """Record this host's settings, or refuse to resume a run made with other ones."""
    path = journal / f"settings_shard-{options.shard_index:03d}-of-{options.num_shards:03d}.json"
    now = options.settings()
    if path.is_file():
        before = read_json(path)
        changed = [k for k in RESUME_KEYS if before.get(k) != now.get(k)]
        if changed:
            key = changed[0]
            raise PipelineError(f"{options.output}: made with other settings ({key}: {before.get(key)!r} then, "
                                f"{now.get(key)!r} now); use another --output or delete that folder")
    write_json(path, now)


def _write_part(output: Path, name: str, states: list[_Turns], stats: PartStats) -> None:
    """The part's counts into the journal first, then its data file: a data file present means
    the part is complete and counted."""
    write_json(output / JOURNAL_DIR / f"{name}.json", stats.to_json())
    with atomic_path(output / f"{name}.jsonl") as tmp, tmp.open("w", encoding="utf-8") as f:
        for state in states:
            if state.outcome in ("regenerated", "kept_as_is"):
                f.write(json.dumps(state.record(), ensure_ascii=False) + "\n")


def _normalise(records: list[tuple[str, Any]], stats: PartStats) -> list[Conversation]:
    conversations = []
    for sample_id, record in records:
        item = to_conversation(sample_id, record)
        if isinstance(item, Rejection):
            stats.dropped[item.reason] += 1
        else:
            conversations.append(item)
    return conversations


def _count(state: _Turns, stats: PartStats) -> None:
    if state.outcome == "regenerated":
        stats.regenerated += 1
        stats.turns += state.turns
        if state.early:
            stats.ended_early[state.early] += 1
    elif state.outcome == "kept_as_is":
        stats.kept_as_is += 1
    else:
        stats.dropped[state.outcome] += 1


def regenerate(options: RegenerateOptions, tokenizer, engine: Engine) -> dict:
    """Run (or resume) this host's share and write its report; returns the report."""
    options.check()
    output = options.output
    journal = output / JOURNAL_DIR
    journal.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(output)
    _check_settings(journal, options)
    regenerator = TurnRegenerator(tokenizer, engine, options)
    total = PartStats()
    resumed = 0
    bar = tqdm(desc="regenerate", unit=" conv", mininterval=1.0, dynamic_ncols=True)
    start = time.perf_counter()
    new_tokens = 0
    for part, records in _host_parts(options):
        name = part_name(options.shard_index, options.num_shards, part)
        if (output / f"{name}.jsonl").is_file():
            total.add(PartStats.from_json(read_json(journal / f"{name}.json")))
            resumed += 1
            continue
        stats = PartStats(records=len(records))
        part_start = time.perf_counter()
        conversations = _normalise(records, stats)
        bar.update(len(records) - len(conversations))

        def done(state: _Turns) -> None:
            _count(state, stats)
            bar.update(1)
            rate = (new_tokens + stats.generated_tokens) / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate:,.1f} tok/s", refresh=False)

        states = regenerator.run(conversations, stats, options.seed + part, done)
        stats.seconds = time.perf_counter() - part_start
        new_tokens += stats.generated_tokens
        _write_part(output, name, states, stats)
        total.add(stats)
    bar.close()
    report = _report(total, options, resumed)
    write_json(output / report_name(options.shard_index, options.num_shards), report)
    return report


def _report(total: PartStats, options: RegenerateOptions, resumed: int) -> dict:
    per = lambda a, b: round(a / b, 2) if b else None  # noqa: E731
    return {
        "settings": options.settings(),
        "records_read": total.records,
        "regenerated": total.regenerated,
        "kept_as_is": total.kept_as_is,
        "dropped": dict(sorted(total.dropped.items())),
        "ended_early": dict(sorted(total.ended_early.items())),
        "assistant_turns_regenerated": total.turns,
        "generations": total.generations,
        "generations_cut_at_limit": total.generations_cut,
        "generation_cut_policy": "kept as the last turn" if options.keep_cut else "turn dropped",
        "tool_calls_emitted": total.tool_calls,
        "mean_prompt_tokens": per(total.prompt_tokens, total.generations),
        "mean_generated_tokens": per(total.generated_tokens, total.generations),
        "mean_turns_per_conversation": per(total.turns, total.regenerated),
        "generated_tokens": total.generated_tokens,
        "generation_seconds": round(total.seconds, 2),
        "tokens_per_second": per(total.generated_tokens, total.seconds),
        "parts_resumed": resumed,
    }


def summary_lines(report: dict, output: Path) -> list[str]:
    lines = [f"read {report['records_read']:,} records: {report['regenerated']:,} regenerated, "
             f"{report['kept_as_is']:,} kept as is, {sum(report['dropped'].values()):,} dropped"]
    for reason, count in report["dropped"].items():
        lines.append(f"  dropped {count:,}: {reason}")
    for reason, count in report["ended_early"].items():
        lines.append(f"  ended early {count:,}: {reason}")
    lines.append(f"{report['generations']:,} generations ({report['generations_cut_at_limit']:,} cut at the token "
                 f"limit, {report['generation_cut_policy']}), mean {report['mean_prompt_tokens']} prompt tokens, "
                 f"{report['mean_generated_tokens']} generated tokens, {report['tokens_per_second']} tokens/s")
    lines.append(f"wrote {output} ({report['parts_resumed']} parts resumed); "
                 f"next: python 01_prepare_data.py --input {output}")
    return lines
