"""05's report: every figure of each draft and baseline, as the side-by-side table and `--json`.

A draft is measured at each k of `--num-speculative-tokens` on the same prompts (`DraftReport.by_k`,
first k first); its offline metrics are computed once at the largest k's TTT steps and read at
each k (the first k steps' accuracies, the simulated acceptance length over them). Figures are
also given per prompt set and per category (MT-Bench's eight): the acceptance length over the
verification passes of those generations, and how many generations (turns) there were.

The same figures go to the experiment trackers (`tracker_scalars`, `served_scalars`) at step = k,
so TensorBoard draws each against k.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.atomic import write_json
from common.draft.validation import simulated_acceptance_length
from common.evaluate.decoding import LOOP_RUN, Generation, SpeculativeStats
from common.evaluate.measure import MeasuredResult, degenerate_share
from common.evaluate.prompts import Prompt

__all__ = ["finite", "DraftReport", "by_prompt_set", "summary_table", "gap_notes", "output_lines",
           "write_report", "TRACKER_PREFIX", "tracker_scalars", "served_scalars"]

GAP = 0.1  # simulated minus measured acceptance length worth explaining
# The contract's top-level keys of --json: the first draft's figures at the first k.
TOP_LEVEL = ("measured_acceptance_length", "simulated_acceptance_length", "acceptance_rate_per_position",
             "identical_to_greedy", "degenerate_share", "distinct_ratio")


def finite(x: float | None) -> float | None:
    """A figure for JSON: rounded, None for a missing or NaN one."""
    return None if x is None or math.isnan(x) else round(float(x), 6)


def by_prompt_set(prompts: list[Prompt], generations: list[Generation], k: int) -> dict:
    """{set: {measured_acceptance_length, generations, acceptance_rate_per_position,
    by_category: {category: {measured_acceptance_length, generations}}}}, sets and categories in
    the order they first occur."""
    sets: dict[str, dict[str | None, list[Generation]]] = {}
    for prompt, generation in zip(prompts, generations, strict=True):
        sets.setdefault(prompt.prompt_set, {}).setdefault(prompt.category, []).append(generation)
    out = {}
    for name, categories in sets.items():
        stats = _stats(k, [g for gens in categories.values() for g in gens])
        out[name] = {"measured_acceptance_length": finite(stats.acceptance_length),
                     "generations": sum(map(len, categories.values())),
                     "acceptance_rate_per_position": [finite(r) for r in stats.acceptance_rate_per_position],
                     "by_category": {c: {"measured_acceptance_length": finite(_stats(k, gens).acceptance_length),
                                         "generations": len(gens)}
                                     for c, gens in categories.items() if c is not None}}
    return out


def _stats(k: int, generations: list[Generation]) -> SpeculativeStats:
    stats = SpeculativeStats(k)
    for g in generations:
        stats.add(g)
    return stats


@dataclass
class DraftReport:
    """Everything reported for one draft or baseline."""

    name: str
    path: str
    by_k: dict[int, MeasuredResult] = field(default_factory=dict)  # measured at each k, first k first
    offline: dict | None = None  # val_loss, loss_per_step, full_acc, cond_acc, simulated AL, samples, tokens

    @property
    def measured(self) -> MeasuredResult | None:
        """Measured at the first k."""
        return next(iter(self.by_k.values()), None)

    def offline_at(self, k: int) -> dict | None:
        """The offline metrics read at k: the first k TTT steps and the simulated acceptance
        length over them (validation loss stays the sum over all the steps it was computed at)."""
        if self.offline is None:
            return None
        steps = {key: self.offline[key][:k] for key in ("loss_per_step", "full_acc", "cond_acc") if key in self.offline}
        if "cond_acc" in steps:
            steps["simulated_acceptance_length"] = simulated_acceptance_length(steps["cond_acc"])
        return {**self.offline, **steps}

    def figures(self, prompts: list[Prompt], decode: Callable[[list[int]], str], k: int | None = None) -> dict:
        """The JSON block of this draft at k (default: the first); `decode(ids) -> str` renders the outputs."""
        k = next(iter(self.by_k), k) if k is None else k
        out: dict = {"name": self.name, "path": self.path}
        offline = self.offline_at(k) if k is not None else self.offline
        out["simulated_acceptance_length"] = (offline or {}).get("simulated_acceptance_length")
        out["offline_skipped_files"] = (offline or {}).get("skipped_files", {})  # damaged hidden-state files left out
        m = self.by_k.get(k)
        if m is not None:
            out.update({
                "num_speculative_tokens": k,
                "measured_acceptance_length": finite(m.stats.acceptance_length),
                "acceptance_rate_per_position": [finite(r) for r in m.stats.acceptance_rate_per_position],
                "identical_to_greedy": m.identical_to_greedy,
                "mismatched_samples": m.mismatched,
                "target_passes": m.stats.passes,
                "tokens_generated": m.tokens,
                "tokens_per_second": finite(m.tokens_per_second),
                "speedup_over_greedy": finite(m.speedup),
                "degenerate_share": finite(m.degenerate_share),
                "distinct_ratio": finite(m.distinct_ratio),
                "by_prompt_set": by_prompt_set(prompts, m.generations, k),
                "generations": [
                    {"sample_id": p.sample_id, "row": p.row, "prompt_set": p.prompt_set, "category": p.category,
                     "turn": p.turn, "prompt_tokens": len(p.ids), "tokens": g.tokens,
                     "accepted_per_pass": g.accepted, "text": decode(g.tokens)}
                    for p, g in zip(prompts, m.generations)],
            })
        if offline is not None:
            out["offline"] = offline
        return out


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}"


@dataclass
class _Column:
    label: str
    k: int
    measured: MeasuredResult | None
    offline: dict


def _columns(reports: list[DraftReport], ks: list[int]) -> list[_Column]:
    """One column per report and k it was measured at, named with its k when there are several
    (no speculation is measured once); a report measured at no k (offline only) gets the first k's."""
    columns = []
    for r in reports:
        measured_ks = [k for k in ks if k in r.by_k] or ks[:1]
        for k in measured_ks:
            label = r.name if len(measured_ks) == 1 else f"{r.name} k={k}"
            columns.append(_Column(label, k, r.by_k.get(k), r.offline_at(k) or {}))
    return columns


def _set_rows(columns: list[_Column], prompts: list[Prompt]) -> list[tuple[str, list]]:
    """Acceptance length per prompt set and per category, with the number of generations."""
    rows: list[tuple[str, list]] = []
    figures = [c.measured and by_prompt_set(prompts, c.measured.generations, c.k) for c in columns]
    first = next((f for f in figures if f), {})
    if list(first) == [prompts[0].prompt_set] and not first[prompts[0].prompt_set]["by_category"]:
        return rows  # one set without categories: the overall rows say it all
    for name, block in first.items():
        rows.append((f"  acceptance length, {name} ({block['generations']} generations)",
                     [f and f[name]["measured_acceptance_length"] for f in figures]))
        for category, cat in block["by_category"].items():
            rows.append((f"    {category} ({cat['generations']})",
                         [f and f[name]["by_category"][category]["measured_acceptance_length"] for f in figures]))
    return rows


def summary_table(reports: list[DraftReport], ks: list[int] | int, plain: list[Generation] | None = None,
                  prompts: list[Prompt] | None = None) -> str:
    """One column per draft or baseline (and per k when there are several), one row per figure:
    the side-by-side comparison, with rows per prompt set and category when `prompts` come from
    sets. The speed row names the share of `plain` (the target's own) generations that loop: a
    looping target makes any draft look fast."""
    ks = [ks] if isinstance(ks, int) else list(ks)
    columns = _columns(reports, ks)
    measured = [c.measured for c in columns]
    offline = [c.offline for c in columns]
    rows: list[tuple[str, list]] = []
    if any(m is not None for m in measured):
        rows.append(("measured acceptance length", [m and finite(m.stats.acceptance_length) for m in measured]))
        if prompts:
            rows += _set_rows(columns, prompts)
        for j in range(max(ks)):
            rows.append((f"  acceptance rate, draft {j + 1}",
                         [m and _at([finite(r) for r in m.stats.acceptance_rate_per_position], j) for m in measured]))
        rows.append(("identical to greedy", [m and m.identical_to_greedy for m in measured]))
        rows.append(("target passes", [m and m.stats.passes for m in measured]))
        rows.append((f"generations looping (a token > {LOOP_RUN}x in a row)",
                     [m and finite(m.degenerate_share) for m in measured]))
        rows.append(("distinct-token ratio", [m and finite(m.distinct_ratio) for m in measured]))
        rows.append(("tokens/s", [m and finite(m.tokens_per_second) for m in measured]))
        loops = f"{100 * degenerate_share(plain):#.3g}% of plain generations loop" if plain else "loops unknown"
        rows.append((f"speedup over plain decoding ({loops})", [m and finite(m.speedup) for m in measured]))
    if any(offline):
        rows.append(("simulated acceptance length", [o.get("simulated_acceptance_length") for o in offline]))
        rows.append(("validation loss", [o.get("val_loss") for o in offline]))
        for j in range(max(ks)):
            rows.append((f"  full accuracy, step {j}", [_at(o.get("full_acc"), j) for o in offline]))
            rows.append((f"  cond. accuracy, step {j}", [_at(o.get("cond_acc"), j) for o in offline]))
    return _layout(["", *(c.label for c in columns)], [[label, *(_fmt(v) for v in values)] for label, values in rows])


def _layout(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(line, widths)))
             for line in [header, *body]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def gap_notes(reports: list[DraftReport]) -> list[str]:
    """A note for each draft whose measured acceptance length falls well short of its simulated
    one: the simulated figure is taken on the dataset's answers, the measured one on the
    target's own continuations, and they part when the two differ."""
    notes = []
    for r in reports:
        k = next(iter(r.by_k), None)
        simulated = (r.offline_at(k) or {}).get("simulated_acceptance_length") if k is not None else None
        if r.measured is None or simulated is None:
            continue
        measured = r.measured.stats.acceptance_length
        if simulated - measured > GAP:
            notes.append(f"note: {r.name} measures {measured:.3f} but simulates {simulated:.3f}: the simulated figure "
                         "scores the dataset's answers, the measured one the target's own greedy continuations; a "
                         "large gap means the training answers are not what the target writes (regenerate them "
                         "with the target, as EAGLE training data usually is)")
    return notes


def output_lines(reports: list[DraftReport], prompts: list[Prompt], decode: Callable[[list[int]], str]) -> list[str]:
    """The first draft's first output, the samples any draft decoded differently from greedy
    decoding, and the gap notes."""
    if not reports or reports[0].measured is None:
        return []
    first = reports[0].measured.generations[0]
    lines = [f"output of {prompts[0].sample_id} ({len(first.tokens)} tokens): {decode(first.tokens)!r}"]
    mismatched = [f"{r.name} k={k}: {', '.join(m.mismatched)}" for r in reports for k, m in r.by_k.items()
                  if m.mismatched]
    if mismatched:
        lines.append(f"NOT identical to greedy decoding: {'; '.join(mismatched)}")
    return lines + gap_notes(reports)


def _at(values: list | None, j: int):
    return values[j] if values is not None and j < len(values) else None


def write_report(path: str | Path, reports: list[DraftReport], prompts: list[Prompt], decode, settings: dict,
                 baselines: dict[str, DraftReport] | None = None, per_draft: dict[str, dict[int, dict]] | None = None,
                 ks: list[int] | None = None) -> None:
    """`--json`: the first draft's figures at the first k at the top level (the command-line
    contract), every draft's under `drafts` (with its `per_draft[name][k]` block, e.g. vLLM's figures),
    each baseline's (`none`, `ngram`, `untrained`) under `baselines`, the settings they were
    measured with, and with several `ks` the same per k under `by_k` = {"3": {drafts, baselines}}."""
    baselines, per_draft, ks = baselines or {}, per_draft or {}, ks or [next(iter(reports[0].by_k), None)]

    def at(k: int | None) -> dict:
        return {"drafts": [r.figures(prompts, decode, k) | per_draft.get(r.name, {}).get(k, {}) for r in reports],
                "baselines": {name: r.figures(prompts, decode, k) for name, r in baselines.items()
                              if k is None or k in r.by_k or not r.by_k}}

    first = at(ks[0])
    top = {key: first["drafts"][0].get(key) for key in TOP_LEVEL}
    out = {**top, **settings, **first}
    if len(ks) > 1:
        out["by_k"] = {str(k): at(k) for k in ks}
    write_json(path, out)


TRACKER_PREFIX = "evaluate"  # the trackers' tags: evaluate/<scope>[/<who>]/<figure>


def tracker_scalars(reports: list[DraftReport], baselines: Mapping[str, DraftReport], prompts: list[Prompt],
                    ks: list[int]) -> dict[int, dict[str, float | None]]:
    """{k: {tag: value}}: `--json`'s figures at each k as tracker scalars (logged at step = k), tagged
    `evaluate/<scope>/<figure>` for the first draft and `evaluate/<scope>/<who>/<figure>` for the
    others (`reference`) and the baselines (`ngram`, `untrained`; no speculation is left out: 1 by
    definition). Scopes: `all` (every prompt: acceptance_length, acceptance_rate/position_<j> for draft
    position j = 1..k, tokens_per_s, speedup_over_greedy, identical_to_greedy as 1/0, degenerate_share,
    distinct_ratio, target_passes, tokens_generated), each prompt set by name (acceptance_length,
    acceptance_rate/position_<j>, category/<c>/acceptance_length), and `offline` (simulated_acceptance_length,
    val_loss). Missing figures are None (the trackers leave them out)."""
    who = [("", r) for r in reports[:1]] + [(r.name, r) for r in reports[1:]]
    who += [(key, r) for key, r in baselines.items() if key != "none"]
    out: dict[int, dict[str, float | None]] = {}
    for k in ks:
        scalars: dict[str, float | None] = {}
        for name, report in who:
            suffix = f"/{_tag_part(name)}" if name else ""
            m = report.by_k.get(k)
            if m is not None:
                scalars |= _acceptance(f"{TRACKER_PREFIX}/all{suffix}", m.stats.acceptance_length,
                                       m.stats.acceptance_rate_per_position)
                identical = m.identical_to_greedy
                scalars |= {f"{TRACKER_PREFIX}/all{suffix}/{figure}": value for figure, value in (
                    ("tokens_per_s", m.tokens_per_second), ("speedup_over_greedy", m.speedup),
                    ("identical_to_greedy", None if identical is None else float(identical)),
                    ("degenerate_share", m.degenerate_share), ("distinct_ratio", m.distinct_ratio),
                    ("target_passes", m.stats.passes), ("tokens_generated", m.tokens))}
                for set_name, block in by_prompt_set(prompts, m.generations, k).items():
                    scope = f"{TRACKER_PREFIX}/{_tag_part(set_name)}{suffix}"
                    scalars |= _acceptance(scope, block["measured_acceptance_length"],
                                           block["acceptance_rate_per_position"])
                    scalars |= {f"{scope}/category/{_tag_part(c)}/acceptance_length": cat["measured_acceptance_length"]
                                for c, cat in block["by_category"].items()}
            offline = report.offline_at(k) or {}
            for figure in ("simulated_acceptance_length", "val_loss"):
                scalars[f"{TRACKER_PREFIX}/offline{suffix}/{figure}"] = offline.get(figure)
        out[k] = scalars
    return out


def served_scalars(served: Mapping[str, Mapping[int, object]], plain_tokens_per_second: float | None = None
                   ) -> dict[int, dict[str, float | None]]:
    """{k: {tag: value}}: vLLM's served figures of each draft (`served[name][k]`, an object with
    `figures()` as common/evaluate/served.py's) under scope `served`, the first draft's without a
    name: acceptance_length, acceptance_rate/position_<j>, tokens_per_s; plain serving's tokens/s as
    `served/plain/tokens_per_s` at each k."""
    out: dict[int, dict[str, float | None]] = {}
    for i, (name, by_k) in enumerate(served.items()):
        suffix = f"/{_tag_part(name)}" if i else ""
        for k, measured in by_k.items():
            figures = measured.figures()
            scope = f"{TRACKER_PREFIX}/served{suffix}"
            scalars = out.setdefault(k, {f"{TRACKER_PREFIX}/served/plain/tokens_per_s": plain_tokens_per_second})
            scalars |= _acceptance(scope, figures["measured_acceptance_length"], figures["acceptance_rate_per_position"])
            scalars[f"{scope}/tokens_per_s"] = figures["tokens_per_second"]
    return out


def _acceptance(scope: str, length: float | None, rates: list[float | None]) -> dict[str, float | None]:
    return {f"{scope}/acceptance_length": length} | {f"{scope}/acceptance_rate/position_{j + 1}": rate
                                                     for j, rate in enumerate(rates)}


def _tag_part(name: str) -> str:
    """A prompt set's, category's or draft's name as one part of a tag (no slash, no space)."""
    return re.sub(r"[^\w.\-]+", "_", str(name)).strip("_") or "_"
