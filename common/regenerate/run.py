"""Step 00's work: conversations -> the same conversations with the target's own answers, this
host's share of the input records regenerated part by part (each conversation turn by turn:
common/regenerate/turns.py), resumable, and the report.

Output folder: `shard-J-of-K-part-C.jsonl` files in OpenAI form (one per `part_size` input
records of shard J; host J of K takes records i with i % K == J), each written atomically once
its part is done; `.journal/` (hidden, so 01 reading the folder skips it) holds each part's
counts, written before the part's data file, and the settings, so a resumed run (the same
command) skips finished parts, regenerates nothing twice and loses nothing, and refuses
different settings. The report `regenerate_report.json` (per host `..._shard-J-of-K_report.json`)
sums the parts.

Given trackers (common/trackers.py; 00's `--report-to`), the run's progress goes to them as scalars
at step = input records done (`_Curves` says which).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.atomic import atomic_path, read_json, remove_stale_temporaries, write_json
from common.errors import PipelineError
from common.prepare.conversations import Conversation, Rejection, to_conversation
from common.prepare.readers import iter_records, resolve_inputs
from common.regenerate.options import RegenerateOptions
from common.regenerate.turns import Engine, PartStats, TurnRegenerator, _Turns
from common.trackers import Trackers

__all__ = ["regenerate", "records_done", "part_name", "report_name", "summary_lines", "JOURNAL_DIR"]

JOURNAL_DIR = ".journal"
PART_FORMAT = "shard-{shard:03d}-of-{shards:03d}-part-{part:06d}"
# Settings that change what is generated: a resumed run must use the same.
RESUME_KEYS = ("inputs", "target", "max_new_tokens", "temperature", "top_p", "seed", "max_samples", "num_shards",
               "shard_index", "part_size", "max_prompt_len", "thinking", "keep_cut", "keep_too_long")
LOG_SECONDS = 10.0  # at most one point of the trackers' curves per this many seconds, and always the totals


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


def records_done(options: RegenerateOptions) -> int:
    """Input records of this host's finished parts (their journal counts): the step a resumed run's
    curves go on from."""
    prefix = part_name(options.shard_index, options.num_shards, 0).rsplit("-", 1)[0]
    done = 0
    for data in options.output.glob(f"{prefix}-*.jsonl"):
        counts = options.output / JOURNAL_DIR / f"{data.stem}.json"
        if counts.is_file():
            done += PartStats.from_json(read_json(counts)).records
    return done


class _Curves:
    """00's scalars in the trackers, at step = input records done (those of the finished parts a
    resumed run found included): `regenerate/conversations_done` (the step itself), `regenerated`,
    `kept_as_is`, `dropped`, `turns_regenerated`, `generations_cut` and `tokens_generated` (counted
    as the report counts them, over every part of this host so far), and `tokens_per_s` (tokens
    this run generated / wall seconds since it began). After a conversation, at most one point per
    `log_seconds`; the totals at the end."""

    def __init__(self, trackers: Trackers | None, log_seconds: float = LOG_SECONDS) -> None:
        self.trackers = trackers or Trackers([])
        self.log_seconds = log_seconds
        self.start = time.perf_counter()
        self.last_time, self.last_step = -math.inf, -1

    def log(self, parts: list[PartStats], new_tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        step = sum(p.regenerated + p.kept_as_is + sum(p.dropped.values()) for p in parts)
        if not self.trackers or step == self.last_step or (not final and now - self.last_time < self.log_seconds):
            return
        count = lambda name: sum(getattr(p, name) for p in parts)  # noqa: E731
        self.trackers.log({"regenerate/conversations_done": step, "regenerate/regenerated": count("regenerated"),
                           "regenerate/kept_as_is": count("kept_as_is"),
                           "regenerate/dropped": sum(sum(p.dropped.values()) for p in parts),
                           "regenerate/turns_regenerated": count("turns"),
                           "regenerate/generations_cut": count("generations_cut"),
                           "regenerate/tokens_generated": count("generated_tokens"),
                           "regenerate/tokens_per_s": new_tokens / max(now - self.start, 1e-9)}, step)
        self.last_time, self.last_step = now, step


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


def regenerate(options: RegenerateOptions, tokenizer, engine: Engine, trackers: Trackers | None = None,
               log_seconds: float = LOG_SECONDS) -> dict:
    """Run (or resume) this host's share and write its report; returns the report. `trackers`: told
    the run's progress (`_Curves`)."""
    options.check()
    output = options.output
    journal = output / JOURNAL_DIR
    journal.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(output)
    _check_settings(journal, options)
    curves = _Curves(trackers, log_seconds)
    curves.trackers.log_params(options.settings())  # the settings a resume must keep, the engine, the target
    regenerator = TurnRegenerator(tokenizer, engine, options)
    total = PartStats()
    resumed = 0
    bar = tqdm(desc="regenerate", unit=" conv", mininterval=1.0, dynamic_ncols=True)
    start = time.perf_counter()
    new_tokens = new_parts = 0
    for part, records in _host_parts(options):
        name = part_name(options.shard_index, options.num_shards, part)
        if (output / f"{name}.jsonl").is_file():
            total.add(PartStats.from_json(read_json(journal / f"{name}.json")))
            resumed += 1
            continue
        stats = PartStats(records=len(records))
        part_start = time.perf_counter()
        new_parts += 1
        conversations = _normalise(records, stats)
        bar.update(len(records) - len(conversations))

        def done(state: _Turns) -> None:
            _count(state, stats)
            bar.update(1)
            rate = (new_tokens + stats.generated_tokens) / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate:,.1f} tok/s", refresh=False)
            curves.log([total, stats], new_tokens + stats.generated_tokens)

        states = regenerator.run(conversations, stats, options.seed + part, done)
        stats.seconds = time.perf_counter() - part_start
        new_tokens += stats.generated_tokens
        _write_part(output, name, states, stats)
        total.add(stats)
    bar.close()
    if new_parts:  # a run that found every part done logs nothing: its totals are the last run's
        curves.log([total], new_tokens, final=True)
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
