"""The draft vocabulary (step 03): supervised-token counts and the `t2d` / `d2t` maps.

An EAGLE-3 draft predicts over a smaller vocabulary than its target: the `draft_vocab_size`
tokens seen most often in supervised positions. Two maps tie the vocabularies together, in the
layout speculators' `Eagle3DraftModel(config, t2d, d2t)` expects:

- `t2d`: bool[target_vocab], True on the target ids kept in the draft vocabulary;
- `d2t`: int64[draft_vocab] offsets, target id = i + d2t[i] for draft id i.

The selection rule is the one of `speculators.train.vocab_mapping.build_vocab_mappings_from_distribution`
(frequency descending, ties by the lower id, a shortfall filled with the lowest unused ids, the
chosen ids sorted), computed here on a dense count tensor instead of a Python dict. Counting reads
the prepared dataset's Arrow columns a batch of rows at a time and bins them with `numpy.bincount`,
so no Python code runs per sample or per token.

The output folder holds `t2d.pt`, `d2t.pt`, `token_freq.pt` (int64[target_vocab], dense: entry i
is the supervised count of token i) and `vocab_report.json` (`VocabReport`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from tqdm import tqdm

from common.atomic import read_stage_report, torch_save, write_dir, write_json
from common.errors import PipelineError

__all__ = [
    "DEFAULT_DRAFT_VOCAB_SIZE", "VocabReport", "VocabMaps", "check_draft_vocab_size",
    "count_supervised_tokens", "select_draft_tokens", "build_maps",
    "make_report", "write_vocab", "load_vocab",
]

FORMAT_VERSION = 1
REPORT_FILE = "vocab_report.json"
T2D_FILE = "t2d.pt"
D2T_FILE = "d2t.pt"
FREQ_FILE = "token_freq.pt"
DEFAULT_DRAFT_VOCAB_SIZE = 32000
DEFAULT_BATCH_ROWS = 4096
TOP_TOKENS = 20
FREQ_LAYOUT = "dense int64[target_vocab_size]: entry i is the supervised count of token id i"


@dataclass
class VocabReport:
    target: str  # resolved target folder
    target_vocab_size: int
    draft_vocab_size: int
    prepared: str  # the prepared dataset folder that was counted
    samples: int
    supervised_tokens: int  # tokens with loss_mask 1, all counted
    distinct_tokens: int  # distinct ids among them
    coverage: float  # share of supervised tokens whose id is in the draft vocabulary
    identity: bool  # draft vocabulary == target vocabulary
    top_tokens: list[dict] = field(default_factory=list)  # [{"id", "count", "share"}], most frequent first
    token_freq_layout: str = FREQ_LAYOUT
    format_version: int = FORMAT_VERSION
    prepared_fingerprint: str = ""  # common/prepare/fingerprints.py; "" in folders of earlier versions


@dataclass
class VocabMaps:
    """A vocabulary folder read back and validated (what step 04 feeds the draft model)."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    report: VocabReport


def check_draft_vocab_size(draft_vocab_size: int, target_vocab_size: int) -> None:
    if draft_vocab_size <= 0:
        raise PipelineError(f"--draft-vocab-size {draft_vocab_size}: must be positive")
    if draft_vocab_size > target_vocab_size:
        raise PipelineError(f"--draft-vocab-size {draft_vocab_size}: larger than the target vocabulary "
                            f"({target_vocab_size}); use {target_vocab_size} for the identity map")


def _flat_numpy(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """(list array, its flattened values as numpy); `flatten` honours slices, `.values` would not."""
    lists = column.combine_chunks()
    return lists, lists.flatten().to_numpy(zero_copy_only=False)


def _sample_at(table: pa.Table, row: int) -> str:
    return str(table.column("sample_id")[row].as_py())


def _check_batch(table: pa.Table, ids_lists: pa.Array, ids: np.ndarray, mask_lists: pa.Array,
                 vocab_size: int) -> None:
    """Name the first sample whose lists are missing, misaligned or hold ids outside the vocabulary."""
    for name, lists in (("input_ids", ids_lists), ("loss_mask", mask_lists)):
        if lists.null_count:
            row = pc.index(pc.is_null(lists), True).as_py()
            raise PipelineError(f"sample {_sample_at(table, row)}: {name} is missing")
    differ = pc.not_equal(pc.list_value_length(ids_lists), pc.list_value_length(mask_lists))
    if pc.any(differ).as_py():
        row = pc.index(differ, True).as_py()
        raise PipelineError(f"sample {_sample_at(table, row)}: input_ids and loss_mask differ in length")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        pos = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
        row = pc.list_parent_indices(ids_lists)[pos].as_py()
        raise PipelineError(f"sample {_sample_at(table, row)}: token id {int(ids[pos])} is outside the "
                            f"target vocabulary (0..{vocab_size - 1}); was it prepared for another target?")


def count_supervised_tokens(ds, vocab_size: int, batch_rows: int = DEFAULT_BATCH_ROWS,
                            progress: bool = True) -> torch.Tensor:
    """int64[vocab_size] counts of the ids under loss_mask != 0 (the library's `loss_mask.to(bool)`)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    columns = ds.select_columns(["sample_id", "input_ids", "loss_mask"]).with_format("arrow")
    with tqdm(total=len(ds), unit="sample", desc="counting", disable=not progress) as bar:
        for table in columns.iter(batch_size=batch_rows):
            ids_lists, ids = _flat_numpy(table.column("input_ids"))
            mask_lists, mask = _flat_numpy(table.column("loss_mask"))
            _check_batch(table, ids_lists, ids, mask_lists, vocab_size)
            counts += np.bincount(ids[mask != 0], minlength=vocab_size)
            bar.update(table.num_rows)
    return torch.from_numpy(counts)


def select_draft_tokens(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary.

    A stable descending sort ranks by count and breaks ties by the lower id; the unseen ids
    (count 0) follow in id order, so taking the first `draft_vocab_size` also fills a shortfall
    with the lowest unused ids, exactly as the library does."""
    check_draft_vocab_size(draft_vocab_size, counts.numel())
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:draft_vocab_size].sort().values


def build_maps(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64[draft] offsets, t2d bool[target]), as `build_vocab_mappings_from_distribution`."""
    selected = select_draft_tokens(counts, draft_vocab_size)
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def make_report(counts: torch.Tensor, t2d: torch.Tensor, *, target: str, prepared: str | Path,
                samples: int) -> VocabReport:
    total = int(counts.sum())
    if total == 0:
        raise PipelineError(f"prepared dataset {prepared}: no supervised tokens (loss_mask is 0 everywhere)")
    top = torch.topk(counts, min(TOP_TOKENS, counts.numel()))
    top_tokens = [{"id": int(i), "count": int(c), "share": int(c) / total}
                  for c, i in zip(top.values, top.indices) if c > 0]
    return VocabReport(
        target=target, target_vocab_size=counts.numel(), draft_vocab_size=int(t2d.sum()),
        prepared=str(prepared), samples=samples, supervised_tokens=total,
        distinct_tokens=int((counts > 0).sum()), coverage=int(counts[t2d].sum()) / total,
        identity=bool(t2d.all()), top_tokens=top_tokens,
    )


def write_vocab(folder: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor,
                report: VocabReport) -> None:
    """Write the four files; the folder appears complete or not at all."""
    def fill(tmp: Path) -> None:
        torch_save(t2d, tmp / T2D_FILE)
        torch_save(d2t, tmp / D2T_FILE)
        torch_save(counts, tmp / FREQ_FILE)
        write_json(tmp / REPORT_FILE, asdict(report))

    write_dir(folder, fill)


def _load_map(path: Path) -> torch.Tensor:
    """One map file; one cut short or damaged (a full disk, a torn copy) is a line naming it."""
    try:
        value = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises
        raise PipelineError(f"vocabulary {path} cannot be read ({type(e).__name__}); run 03_build_vocab_map.py "
                            "again") from e
    if not isinstance(value, torch.Tensor):
        raise PipelineError(f"vocabulary {path} holds a {type(value).__name__}, not a tensor; run "
                            "03_build_vocab_map.py again")
    return value


def load_vocab(folder: str | Path, target_vocab_size: int | None = None) -> VocabMaps:
    """Read a vocabulary folder and check the maps agree with each other (and with the target)."""
    folder = Path(folder)
    missing = [f for f in (REPORT_FILE, T2D_FILE, D2T_FILE) if not (folder / f).is_file()]
    if missing:
        raise PipelineError(f"vocabulary {folder}: {', '.join(missing)} missing (run 03_build_vocab_map.py first)")
    data = read_stage_report(folder / REPORT_FILE, FORMAT_VERSION)
    report = VocabReport(**{k: v for k, v in data.items() if k in VocabReport.__dataclass_fields__})
    d2t, t2d = _load_map(folder / D2T_FILE), _load_map(folder / T2D_FILE)
    if target_vocab_size is not None and t2d.numel() != target_vocab_size:
        raise PipelineError(f"vocabulary {folder}: t2d covers {t2d.numel()} ids, the target has {target_vocab_size}")
    mapped = d2t + torch.arange(d2t.numel())
    if (t2d.dtype != torch.bool or d2t.dtype != torch.long or d2t.numel() == 0
            or int(t2d.sum()) != d2t.numel() or mapped.min() < 0 or mapped.max() >= t2d.numel()
            or not t2d[mapped].all()):
        raise PipelineError(f"vocabulary {folder}: t2d.pt and d2t.pt do not describe the same draft vocabulary")
    return VocabMaps(d2t=d2t, t2d=t2d, report=report)
