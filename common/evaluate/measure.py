"""Measuring drafts (step 05): the acceptance length of real speculative decoding of the prompts
(`common/evaluate/prompts.py`) against plain decoding of the target, and the offline metrics over
held-out hidden-state files; `common/evaluate/report.py` lays the figures out.

Held-out samples: 04 writes the prepared rows it validated on into the draft folder
(`validation_split.json`); file `data_{i}.pt` is prepared row i. 05 takes prompts and offline
metrics from exactly those rows. Without such a record (a draft trained elsewhere, or
`--val-ratio 0`) every file of `--data` is evaluated and prompts come from the last rows of the
prepared dataset; the summary says which rule was used.

Baselines on the same prompts and settings: no speculation (acceptance length 1), n-gram prompt
lookup (vLLM's `ngram` method) and the draft at its initial weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from common.atomic import read_json
from common.draft.model import WEIGHTS_FILE, build_draft, read_saved_config, saved_tensor
from common.draft.validation import ValSummary, validation_metrics
from common.errors import PipelineError
from common.evaluate.decoding import (
    LOOP_RUN,
    Generation,
    SamplingParams,
    SpeculativeStats,
    distinct_ratio,
    longest_run,
    plain_generate,
    speculative_generate,
)
from common.evaluate.prompt_sets import PromptItem
from common.evaluate.prompts import ChatPrompter, Prompt, ask_turns
from common.evaluate.proposers import DraftProposer, NgramProposer
from common.extract.hf_engine import capture_layers
from common.hidden_states.loader import SPLIT_FILE, HiddenStateData, epoch_tokens, make_loader
from common.hidden_states.state_files import sample_index
from common.prepare.fingerprints import prepared_fingerprint
from common.target.config import TargetInfo
from common.target.model import decoder_parts

DEFAULT_EVAL_SEQ_LEN = 2048  # packed tokens per offline batch when the training run's is unknown

__all__ = [
    "check_draft", "HeldOut", "held_out", "check_prepared_of_split", "check_data", "offline_metrics",
    "fitting_offline_metrics",
    "training_seq_len", "MeasuredResult", "degenerate_share", "mean_distinct_ratio", "measure_plain",
    "measure_plain_turns", "measure_proposer", "measure_draft", "measure_ngram", "untrained_draft", "no_speculation",
    "BASELINES", "measure_each_k",
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
    """The prepared rows 04 held out, as it wrote them into the draft folder (`SPLIT_FILE`), and
    their hidden-state files in `data`; without such a record (a draft trained elsewhere, or
    `--val-ratio 0`) every file, and prompts from the last rows. `max_samples` keeps the files of
    the highest rows."""
    split_path = Path(draft_dir) / SPLIT_FILE
    rows = _validation_rows(split_path, data)
    if data is None:
        if rows is None:
            return HeldOut(None, None, "no hidden states: prompts from the last prepared rows")
        return HeldOut(None, rows, f"04's validation rows ({len(rows):,}), from {split_path}")
    files = data.files if rows is None else [f for f in data.files if sample_index(f) in set(rows)]
    files = sorted(files, key=sample_index)[-max_samples:] if max_samples else files
    if rows is None:
        return HeldOut(files, None, f"{len(files):,} of the {len(data.files):,} files of {data.folder} (no training "
                                    "split known; they may include training samples), prompts from the last rows")
    return HeldOut(files, rows, f"04's validation rows ({len(rows):,}; offline metrics over {len(files):,} files), "
                                f"from {split_path}")


def _validation_rows(split_path: Path, data: HiddenStateData | None) -> list[int] | None:
    """The validation rows 04 recorded, when it recorded some for these very hidden states."""
    if not split_path.is_file():
        return None
    record = read_json(split_path)
    rows = record.get("validation_rows") or []
    same_data = data is None or _same_hidden_states(record, split_path.parent, data)
    return sorted(int(r) for r in rows) if rows and same_data else None


def _same_hidden_states(record: dict, draft_dir: Path, data: HiddenStateData) -> bool:
    """Whether `data` holds the rows the split speaks of: the same prepared dataset by its
    fingerprint, wherever the run folder was moved or copied; by the folder's path (relative
    to the draft folder, or absolute in drafts of earlier versions) when either has none."""
    theirs, ours = record.get("prepared_fingerprint"), data.config.prepared_fingerprint
    if theirs and ours:
        return theirs == ours
    return (draft_dir / record.get("hidden_states", "")).resolve() == data.folder.resolve()


def check_prepared_of_split(draft_dir: str | Path, prepared_dir: str | Path) -> None:
    """Refuse a prepared dataset that is not the one the draft was trained on (01 run again, or
    another run's folder): 04's held-out rows would name other conversations, or rows past its
    end. A draft without a split, or a split of an earlier version, is not checked."""
    split_path = Path(draft_dir) / SPLIT_FILE
    theirs = read_json(split_path).get("prepared_fingerprint") if split_path.is_file() else None
    ours = prepared_fingerprint(prepared_dir)
    if theirs and theirs != ours:
        raise PipelineError(f"prepared dataset {prepared_dir} is not the one draft {draft_dir} was trained on "
                            f"(prepared fingerprint {ours}, {split_path} records {theirs}): its held-out rows would "
                            "be other conversations; pass --prepared of that run, or train the draft again")


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
    loader = make_loader(data, files, HeldOutLoading(total_seq_len), world_size=1, rank=0, train=False,
                         pin_memory=False)
    summary = ValSummary.from_metrics(validation_metrics(draft, loader, device, {"ttt_steps": k}), epoch=0)
    skipped = loader.tally.skipped  # damaged files, each named on stderr (common/hidden_states/skip_damaged.py)
    return {"skipped_files": skipped, "val_loss": summary.loss, "loss_per_step": summary.loss_per_step,
            "full_acc": summary.full_acc,
            "cond_acc": summary.cond_acc, "simulated_acceptance_length": summary.acceptance_length,
            "samples": len(files), "tokens": epoch_tokens(data, files, total_seq_len)}


def fitting_offline_metrics(name: str, draft: torch.nn.Module, folder: Path, info: TargetInfo,
                            data: HiddenStateData | None, files: list[Path] | None, k: int, total_seq_len: int,
                            device: torch.device) -> dict | None:
    """`offline_metrics` of draft `name` when there are hidden states and they fit it; None
    otherwise. States that do not fit the draft under evaluation (`draft`) are an error, for a
    reference they only skip its offline metrics (it may read other layers)."""
    if data is None:
        return None
    try:
        check_data(data, info, list(draft.config.eagle_aux_hidden_state_layer_ids), folder)
    except PipelineError as e:
        if name == "draft":
            raise
        print(f"offline metrics of {name} skipped: {e}")
        return None
    metrics = offline_metrics(draft, data, files, k, total_seq_len, device)
    if metrics["skipped_files"]:
        print(f"offline metrics of {name}: skipped {len(metrics['skipped_files'])} of {len(files)} hidden-state files "
              "that could not be used")
    return metrics


def training_seq_len(draft_dir: str | Path) -> int:
    """The packed sequence length the draft was validated with in 04, if its split record says (drafts
    of earlier versions and of other tools: `DEFAULT_EVAL_SEQ_LEN`)."""
    split_path = Path(draft_dir) / SPLIT_FILE
    record = read_json(split_path) if split_path.is_file() else {}
    return int(record.get("total_seq_len", DEFAULT_EVAL_SEQ_LEN))


@dataclass(frozen=True)
class HeldOutLoading:
    """The data path's settings of 05's offline figures: 04's validation pass (no noise, one process)."""

    total_seq_len: int
    seed: int = 0
    noise_std: float = 0.0
    num_workers: int = 0


@dataclass
class MeasuredResult:
    """Speculative decoding with one proposer over the prompts, against plain decoding of the target."""

    k: int
    stats: SpeculativeStats
    generations: list[Generation]
    mismatched: list[str] = field(default_factory=list)  # sample ids whose tokens differ from greedy
    seconds: float = 0.0
    greedy_seconds: float = 0.0  # plain decoding of the same prompts (greedy or sampled alike)
    compared: bool = True  # greedy: each output checked against plain greedy decoding
    plain_tokens: int = 0  # tokens of that plain decoding

    @property
    def tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def identical_to_greedy(self) -> bool | None:
        """None when sampling: outputs are then equal in distribution, not token by token."""
        return not self.mismatched if self.compared else None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def speedup(self) -> float:
        """Speculative over plain decoding, per-token time (sampled runs differ in tokens)."""
        plain_tokens = self.plain_tokens or self.tokens
        if not self.seconds or not self.greedy_seconds:
            return float("nan")
        return (self.greedy_seconds / plain_tokens) / (self.seconds / self.tokens)

    @property
    def degenerate_share(self) -> float:
        return degenerate_share(self.generations)

    @property
    def distinct_ratio(self) -> float:
        return mean_distinct_ratio(self.generations)


def degenerate_share(generations: list[Generation]) -> float:
    """Share of generations with a token repeated more than LOOP_RUN times in a row."""
    return sum(longest_run(g.tokens) > LOOP_RUN for g in generations) / len(generations) if generations else 0.0


def mean_distinct_ratio(generations: list[Generation]) -> float:
    """Mean over generations of distinct tokens / tokens."""
    return sum(distinct_ratio(g.tokens) for g in generations) / len(generations) if generations else float("nan")


def _generator(seed: int, prompt: Prompt) -> torch.Generator:
    """One random stream per prompt, the same for every proposer and for plain decoding."""
    return torch.Generator().manual_seed(seed * 1_000_003 + prompt.row)


def measure_plain(target: torch.nn.Module, prompts: list[Prompt], max_new_tokens: int, stop_ids: set[int],
                  sampling: SamplingParams = SamplingParams(), seed: int = 0,
                  show_progress: bool = True) -> list[Generation]:
    """The reference: plain decoding of the target alone (greedy or sampled), per prompt."""
    desc = "greedy" if sampling.greedy else "sampling"
    return [plain_generate(target, p.ids, max_new_tokens, stop_ids, sampling, _generator(seed, p))
            for p in tqdm(prompts, desc=desc, unit="prompt", disable=not show_progress)]


def measure_plain_turns(target: torch.nn.Module, sets: dict[str, list[PromptItem]], prompter: ChatPrompter,
                        max_new_tokens: int, stop_ids: set[int], sampling: SamplingParams = SamplingParams(),
                        seed: int = 0) -> tuple[list[Prompt], list[Generation]]:
    """Every turn of every item of the prompt sets, and its plain decoding: turn by turn, each
    turn's prompt holding the target's own (plain) answers to the turns before it."""
    plain: dict[int, Generation] = {}

    def answer(prompts: list[Prompt]) -> list[list[int]]:
        generations = measure_plain(target, prompts, max_new_tokens, stop_ids, sampling, seed)
        for prompt, generation in zip(prompts, generations):
            plain[prompt.row] = generation
        return [plain[p.row].tokens for p in prompts]

    prompts = ask_turns(sets, prompter, answer, stop_ids)
    return prompts, [plain[p.row] for p in prompts]


def measure_proposer(target: torch.nn.Module, proposer, layer_ids: list[int], prompts: list[Prompt],
                     plain: list[Generation], k: int, max_new_tokens: int, stop_ids: set[int],
                     sampling: SamplingParams = SamplingParams(), seed: int = 0, desc: str = "speculative",
                     show_progress: bool = True) -> MeasuredResult:
    """Speculative decoding of every prompt with `proposer` (a draft's `DraftProposer`, or
    `NgramProposer` with no layers); greedy outputs are checked token by token against `plain`."""
    _, layers = decoder_parts(target)
    result = MeasuredResult(k=k, stats=SpeculativeStats(k), generations=[], compared=sampling.greedy,
                            plain_tokens=sum(len(g.tokens) for g in plain))
    with capture_layers(layers, layer_ids) as captured:
        for prompt, reference in zip(tqdm(prompts, desc=desc, unit="prompt", disable=not show_progress), plain):
            generation = speculative_generate(target, captured, layer_ids, proposer, prompt.ids, k,
                                              max_new_tokens, stop_ids, sampling, _generator(seed, prompt))
            result.generations.append(generation)
            result.stats.add(generation)
            result.seconds += generation.seconds
            result.greedy_seconds += reference.seconds
            if sampling.greedy and generation.tokens != reference.tokens:
                result.mismatched.append(prompt.sample_id)
    return result


def measure_draft(target: torch.nn.Module, draft: torch.nn.Module, prompts: list[Prompt], plain: list[Generation],
                  k: int, max_new_tokens: int, stop_ids: set[int], sampling: SamplingParams = SamplingParams(),
                  seed: int = 0, desc: str = "speculative", show_progress: bool = True) -> MeasuredResult:
    """Speculative decoding of every prompt with an EAGLE-3 `draft`."""
    return measure_proposer(target, DraftProposer(draft), list(draft.config.eagle_aux_hidden_state_layer_ids),
                            prompts, plain, k, max_new_tokens, stop_ids, sampling, seed, desc, show_progress)


def measure_ngram(target: torch.nn.Module, prompts: list[Prompt], plain: list[Generation], k: int,
                  max_new_tokens: int, stop_ids: set[int], sampling: SamplingParams = SamplingParams(),
                  seed: int = 0, show_progress: bool = True) -> MeasuredResult:
    """The n-gram prompt-lookup baseline (vLLM's `ngram` method, n from 3 down to 1)."""
    return measure_proposer(target, NgramProposer(), [], prompts, plain, k, max_new_tokens, stop_ids, sampling,
                            seed, "n-gram", show_progress)


def untrained_draft(draft: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A fresh draft of the same config and vocabulary maps (the target's frozen embedding and
    lm_head, everything else at its initial values): the floor a trained draft must clear."""
    torch.manual_seed(seed)
    fresh = build_draft(draft.config, draft.t2d.cpu(), draft.d2t.cpu())
    return fresh.to(device=draft.fc.weight.device, dtype=draft.fc.weight.dtype).eval()


def no_speculation(plain: list[Generation], k: int, greedy: bool = True) -> MeasuredResult:
    """Plain decoding as a column of the table: one token per target pass (acceptance length 1)."""
    stats = SpeculativeStats(k)
    # one pass per token after the first: the prefill pass emits it and is not counted, as for the drafts
    generations = [Generation(g.prompt_len, g.tokens, g.seconds, accepted=[0] * max(0, len(g.tokens) - 1))
                   for g in plain]
    for g in generations:
        stats.add(g)
    seconds = sum(g.seconds for g in plain)
    return MeasuredResult(k=k, stats=stats, generations=generations, seconds=seconds, greedy_seconds=seconds,
                          compared=greedy)


# Baselines measured beside the drafts: key -> (column name, what it is).
BASELINES = {"ngram": ("n-gram", "prompt lookup, n 3..1"), "untrained": ("untrained", "draft at its initial weights")}


def measure_each_k(target: torch.nn.Module, drafts: dict[str, torch.nn.Module], prompts: list[Prompt],
                   plain: list[Generation], ks: list[int], max_new_tokens: int, stop_ids: set[int],
                   sampling: SamplingParams = SamplingParams(), seed: int = 0,
                   baselines: bool = True) -> dict[str, dict[int, MeasuredResult]]:
    """{name: {k: result}}: speculative decoding of the prompts with each draft at each k, and
    with `baselines` the BASELINES (the untrained one: the first draft's config at initial weights)."""
    proposers: dict[str, tuple[Callable[[], Any], list[int]]] = {
        name: (lambda d=draft: DraftProposer(d), list(draft.config.eagle_aux_hidden_state_layer_ids))
        for name, draft in drafts.items()}
    if baselines:
        untrained = untrained_draft(next(iter(drafts.values())))
        proposers["ngram"] = (NgramProposer, [])
        proposers["untrained"] = (lambda: DraftProposer(untrained), proposers[next(iter(drafts))][1])
    out: dict[str, dict[int, MeasuredResult]] = {name: {} for name in proposers}
    for k in ks:
        for name, (proposer, layer_ids) in proposers.items():
            out[name][k] = measure_proposer(target, proposer(), layer_ids, prompts, plain, k, max_new_tokens,
                                            stop_ids, sampling, seed, f"{name} k={k}")
    return out
