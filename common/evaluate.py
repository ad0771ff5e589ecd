"""Evaluating drafts (step 05): measured acceptance length by real speculative decoding,
offline metrics over held-out hidden-state files, and the side-by-side report.

Held-out samples: 04 writes `train_report.json` next to the draft folder, with the seed and
validation share of its split; the same library call (`split_files`) on the same hidden-state
folder gives back its validation files, and file `data_{i}.pt` is prepared row i. Without such
a report (a draft trained elsewhere, or `--val-ratio 0`) every file of `--data` is evaluated
and prompts come from the last rows of the prepared dataset; the summary says which rule was
used. A prompt is a sample's tokens up to its first supervised token (loss_mask 1): the
conversation up to where the assistant starts answering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from common.atomic import read_json, write_json
from common.draft import WEIGHTS_FILE, read_saved_config, saved_tensor
from common.errors import PipelineError
from common.extract_io import sample_index
from common.hidden_states import capture_layers, decoder_parts
from common.speculative import DraftProposer, Generation, SpeculativeStats, greedy_generate, speculative_generate
from common.target import TargetInfo
from common.training import (
    REPORT_FILE,
    HiddenStateData,
    TrainSettings,
    ValSummary,
    epoch_tokens,
    evaluate,
    make_loader,
    split_data,
)

DEFAULT_EVAL_SEQ_LEN = 2048  # packed tokens per offline batch when the training run's is unknown

__all__ = [
    "check_draft", "HeldOut", "held_out", "check_data", "offline_metrics", "training_seq_len", "Prompt",
    "select_prompts", "MeasuredResult", "measure_greedy", "measure_draft", "DraftReport", "summary_table",
    "gap_notes", "write_report",
]


def check_draft(folder: str | Path, info: TargetInfo) -> None:
    """A draft folder in speculators format that fits the target (hidden size, vocabulary,
    auxiliary layer ids), checked before anything is built; errors name the folder and the values."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PipelineError(f"draft {folder}: no such folder (train one with 04_train.py)")
    try:
        model_type = read_json(folder / "config.json").get("speculators_model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise PipelineError(f"draft {folder}: no readable config.json ({type(e).__name__}: {e})") from e
    if model_type != "eagle3":
        raise PipelineError(f"draft {folder}: config.json is not a speculators EAGLE-3 draft "
                            f"(speculators_model_type {model_type!r}, expected 'eagle3')")
    config = read_saved_config(folder)
    if not (folder / WEIGHTS_FILE).is_file():
        raise PipelineError(f"draft {folder}: no {WEIGHTS_FILE}")
    layer = config.transformer_layer_config
    if layer.hidden_size != info.hidden_size:
        raise PipelineError(f"draft {folder} has hidden size {layer.hidden_size}, but target {info.path} has "
                            f"{info.hidden_size}: it was trained for another target")
    t2d = saved_tensor(folder, "t2d")
    vocab = t2d.numel() if t2d is not None else layer.vocab_size
    if vocab != info.vocab_size or layer.vocab_size != info.vocab_size:
        raise PipelineError(f"draft {folder} maps a target vocabulary of {vocab:,} ids, but target {info.path} has "
                            f"{info.vocab_size:,}: it was trained for another target")
    ids = list(config.eagle_aux_hidden_state_layer_ids or [])
    n = info.num_layers
    if len(ids) != 3 or not all(1 <= i <= n - 1 for i in ids):
        raise PipelineError(f"draft {folder} reads auxiliary layers {ids}, but target {info.path} has {n} layers "
                            f"(three ids in 1..{n - 1} expected): it was trained for another target")


@dataclass
class HeldOut:
    """The samples no draft was trained on, as far as the draft folder tells."""

    files: list[Path] | None  # hidden-state files to evaluate offline; None: no data folder
    rows: list[int] | None  # prepared rows to take prompts from; None: the dataset's last rows
    rule: str  # how they were chosen, for the summary


def held_out(draft_dir: str | Path, data: HiddenStateData | None, max_samples: int | None = None) -> HeldOut:
    """04's validation split of `data` when the training report next to the draft says how it
    was made from this very folder; otherwise every file, and prompts from the last rows.
    `max_samples` keeps the files of the highest rows (the end of the prepared dataset)."""
    if data is None:
        return HeldOut(None, None, "no hidden states: prompts from the last prepared rows")
    split = _validation_split(draft_dir, data)
    files = split if split is not None else data.files
    files = sorted(files, key=sample_index)[-max_samples:] if max_samples else files
    if split is None:
        return HeldOut(files, None, f"{len(files):,} of the {len(data.files):,} files of {data.folder} (no training "
                                    "split known; they may include training samples), prompts from the last rows")
    rows = sorted(sample_index(f) for f in split)
    return HeldOut(files, rows, f"04's validation split ({len(split):,} samples; offline metrics over "
                                f"{len(files):,}), from {Path(draft_dir).parent / REPORT_FILE}")


def _validation_split(draft_dir: str | Path, data: HiddenStateData) -> list[Path] | None:
    report_path = Path(draft_dir).parent / REPORT_FILE
    if not report_path.is_file():
        return None
    report = read_json(report_path)
    same_draft = Path(report.get("draft", "")).resolve() == Path(draft_dir).resolve()
    same_data = Path(report.get("data", "")).resolve() == data.folder.resolve()
    settings = report.get("settings", {})
    if not (same_draft and same_data and settings.get("val_ratio", 0) > 0):
        return None
    _, val = split_data(data, settings["val_ratio"], settings["seed"])
    return [Path(f) for f in val]


def check_data(data: HiddenStateData, info: TargetInfo, layer_ids: list[int], draft_dir: Path) -> None:
    """Offline metrics mean something only on states of this target at the draft's layers."""
    cfg = data.config
    if cfg.hidden_size != info.hidden_size or cfg.vocab_size != info.vocab_size:
        raise PipelineError(f"hidden states {data.folder} come from target {cfg.target} (hidden size "
                            f"{cfg.hidden_size}, vocabulary {cfg.vocab_size:,}), not from {info.path}")
    if list(cfg.layer_ids) != list(layer_ids):
        flag = " ".join(map(str, layer_ids))
        raise PipelineError(f"hidden states {data.folder} hold layers {cfg.layer_ids}, but draft {draft_dir} "
                            f"reads layers {layer_ids}: extract them with 02 --layer-ids {flag}")


def offline_metrics(draft: torch.nn.Module, data: HiddenStateData, files: list[Path], k: int,
                    total_seq_len: int, device: torch.device) -> dict:
    """Validation loss, full and conditional accuracy per TTT step and the simulated
    acceptance length over `files`, computed exactly as 04's validation pass does."""
    settings = TrainSettings(ttt_steps=k, noise_std=0.0, total_seq_len=total_seq_len, num_workers=0)
    loader = make_loader(data, files, settings, world_size=1, rank=0, train=False, pin_memory=False)
    summary = ValSummary.from_metrics(evaluate(draft, loader, device, settings), epoch=0)
    return {"val_loss": summary.loss, "loss_per_step": summary.loss_per_step, "full_acc": summary.full_acc,
            "cond_acc": summary.cond_acc, "simulated_acceptance_length": summary.acceptance_length,
            "samples": len(files), "tokens": epoch_tokens(data, files, total_seq_len)}


def training_seq_len(draft_dir: str | Path) -> int:
    """The packed sequence length the draft was validated with in 04, if its report says."""
    report_path = Path(draft_dir).parent / REPORT_FILE
    if report_path.is_file():
        return int(read_json(report_path).get("settings", {}).get("total_seq_len", DEFAULT_EVAL_SEQ_LEN))
    return DEFAULT_EVAL_SEQ_LEN


@dataclass(frozen=True)
class Prompt:
    row: int  # row of the prepared dataset
    sample_id: str
    ids: list[int]


def select_prompts(ds, max_prompts: int, rows: list[int] | None = None) -> tuple[list[Prompt], int]:
    """Up to `max_prompts` prompts from `rows` (default: the dataset's last rows), in row order;
    also the number of candidate rows skipped (no supervised token, or nothing before it)."""
    candidates = list(range(len(ds))) if rows is None else sorted(rows)
    prompts, skipped = [], 0
    for row in reversed(candidates):
        if len(prompts) == max_prompts:
            break
        sample = ds[row]
        mask = sample["loss_mask"]
        first = mask.index(1) if 1 in mask else 0
        if first < 1:
            skipped += 1
            continue
        prompts.append(Prompt(row, str(sample["sample_id"]), list(sample["input_ids"][:first])))
    if not prompts:
        raise PipelineError(f"none of the {len(candidates)} candidate prepared samples has a prompt "
                            "(tokens before its first supervised token)")
    return prompts[::-1], skipped


@dataclass
class MeasuredResult:
    """Speculative decoding of one draft over the prompts, against plain greedy decoding."""

    k: int
    stats: SpeculativeStats
    generations: list[Generation]
    mismatched: list[str] = field(default_factory=list)  # sample ids whose tokens differ from greedy
    seconds: float = 0.0
    greedy_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def identical_to_greedy(self) -> bool:
        return not self.mismatched

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def speedup(self) -> float:
        """Speculative over plain greedy tokens per second (same tokens when lossless)."""
        return self.greedy_seconds / self.seconds if self.seconds else float("nan")


def measure_greedy(target: torch.nn.Module, prompts: list[Prompt], max_new_tokens: int, stop_ids: set[int],
                   show_progress: bool = True) -> list[Generation]:
    """The reference: plain greedy decoding of the target alone, per prompt."""
    return [greedy_generate(target, p.ids, max_new_tokens, stop_ids)
            for p in tqdm(prompts, desc="greedy", unit="prompt", disable=not show_progress)]


def measure_draft(target: torch.nn.Module, draft: torch.nn.Module, prompts: list[Prompt], greedy: list[Generation],
                  k: int, max_new_tokens: int, stop_ids: set[int], desc: str = "speculative",
                  show_progress: bool = True) -> MeasuredResult:
    """Speculative decoding of every prompt with `draft`, checked token by token against `greedy`."""
    layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
    proposer = DraftProposer(draft)
    _, layers = decoder_parts(target)
    result = MeasuredResult(k=k, stats=SpeculativeStats(k), generations=[])
    with capture_layers(layers, layer_ids) as captured:
        for prompt, reference in zip(tqdm(prompts, desc=desc, unit="prompt", disable=not show_progress), greedy):
            generation = speculative_generate(target, captured, layer_ids, proposer, prompt.ids, k,
                                              max_new_tokens, stop_ids)
            result.generations.append(generation)
            result.stats.add(generation)
            result.seconds += generation.seconds
            result.greedy_seconds += reference.seconds
            if generation.tokens != reference.tokens:
                result.mismatched.append(prompt.sample_id)
    return result


@dataclass
class DraftReport:
    """Everything reported for one draft."""

    name: str
    path: str
    measured: MeasuredResult | None = None
    offline: dict | None = None  # val_loss, full_acc, cond_acc, simulated_acceptance_length, samples, tokens

    def figures(self, prompts: list[Prompt], decode) -> dict:
        """The JSON block of this draft (`decode(ids) -> str` renders the output texts)."""
        out: dict = {"name": self.name, "path": self.path}
        offline = self.offline or {}
        out["simulated_acceptance_length"] = offline.get("simulated_acceptance_length")
        if self.measured is not None:
            m = self.measured
            out.update({
                "measured_acceptance_length": _finite(m.stats.acceptance_length),
                "acceptance_rate_per_position": [_finite(r) for r in m.stats.acceptance_rate_per_position],
                "identical_to_greedy": m.identical_to_greedy,
                "mismatched_samples": m.mismatched,
                "target_passes": m.stats.passes,
                "tokens_generated": m.tokens,
                "tokens_per_second": _finite(m.tokens_per_second),
                "speedup_over_greedy": _finite(m.speedup),
                "generations": [
                    {"sample_id": p.sample_id, "row": p.row, "prompt_tokens": len(p.ids), "tokens": g.tokens,
                     "accepted_per_pass": g.accepted, "text": decode(g.tokens)}
                    for p, g in zip(prompts, m.generations)],
            })
        if self.offline is not None:
            out["offline"] = self.offline
        return out


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(float(x), 6)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}"


def summary_table(reports: list[DraftReport], k: int) -> str:
    """One column per draft, one row per figure: the side-by-side comparison."""
    rows: list[tuple[str, list]] = []
    measured = [r.measured for r in reports]
    offline = [r.offline or {} for r in reports]
    if any(m is not None for m in measured):
        rows.append(("measured acceptance length", [m and _finite(m.stats.acceptance_length) for m in measured]))
        for j in range(k):
            rows.append((f"  acceptance rate, draft {j + 1}",
                         [m and _finite(m.stats.acceptance_rate_per_position[j]) for m in measured]))
        rows.append(("identical to greedy", [m and m.identical_to_greedy for m in measured]))
        rows.append(("target passes", [m and m.stats.passes for m in measured]))
        rows.append(("speculative tokens/s", [m and _finite(m.tokens_per_second) for m in measured]))
        rows.append(("speedup over greedy", [m and _finite(m.speedup) for m in measured]))
    if any(offline):
        rows.append(("simulated acceptance length", [o.get("simulated_acceptance_length") for o in offline]))
        rows.append(("validation loss", [o.get("val_loss") for o in offline]))
        for j in range(k):
            rows.append((f"  full accuracy, step {j}", [_at(o.get("full_acc"), j) for o in offline]))
            rows.append((f"  cond. accuracy, step {j}", [_at(o.get("cond_acc"), j) for o in offline]))
    header = ["", *(r.name for r in reports)]
    body = [[label, *(_fmt(v) for v in values)] for label, values in rows]
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(line, widths)))
             for line in [header, *body]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


GAP = 0.1  # simulated minus measured acceptance length worth explaining


def gap_notes(reports: list[DraftReport]) -> list[str]:
    """A note for each draft whose measured acceptance length falls well short of its simulated
    one: the simulated figure is taken on the dataset's answers, the measured one on the
    target's own continuations, and they part when the two differ."""
    notes = []
    for r in reports:
        simulated = (r.offline or {}).get("simulated_acceptance_length")
        if r.measured is None or simulated is None:
            continue
        measured = r.measured.stats.acceptance_length
        if simulated - measured > GAP:
            notes.append(f"note: {r.name} measures {measured:.3f} but simulates {simulated:.3f}: the simulated figure "
                         "scores the dataset's answers, the measured one the target's own greedy continuations; a "
                         "large gap means the training answers are not what the target writes (regenerate them "
                         "with the target, as EAGLE training data usually is)")
    return notes


def _at(values: list | None, j: int):
    return values[j] if values is not None and j < len(values) else None


def write_report(path: str | Path, reports: list[DraftReport], prompts: list[Prompt], decode, settings: dict,
                 per_draft: dict[str, dict] | None = None) -> None:
    """`--json`: the first draft's figures at the top level (the command-line contract), every
    draft's under `drafts` (with its `per_draft` block, e.g. vLLM's figures), and the settings."""
    drafts = [r.figures(prompts, decode) | (per_draft or {}).get(r.name, {}) for r in reports]
    top = {key: drafts[0].get(key) for key in ("measured_acceptance_length", "simulated_acceptance_length",
                                                "acceptance_rate_per_position", "identical_to_greedy")}
    write_json(path, {**top, **settings, "drafts": drafts})
