"""The prepared dataset: the contract between step 01 and steps 02, 03 and 05.

A Hugging Face dataset saved with `save_to_disk` (loadable with `datasets.load_from_disk`) holding one row per kept conversation:
`sample_id` (str, the input's id or `<file>:<line>`), `input_ids` (list[int]), `loss_mask`
(list[int], 1 on supervised tokens) and `num_tokens` (int). Next to it `prepare_report.json`
(`PrepareReport`) says which tokenizer and target produced it, so later stages can refuse
data made for another target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
from datasets import load_from_disk

from common.atomic import read_stage_report, write_json
from common.errors import PipelineError
from common.target.config import target_digest

FORMAT_VERSION = 1
REPORT_FILE = "prepare_report.json"
COLUMNS = ("sample_id", "input_ids", "loss_mask", "num_tokens")


@dataclass
class PrepareReport:
    target: str  # resolved target folder
    tokenizer: str  # tokenizer class name
    vocab_size: int  # the target's vocabulary size (ids must stay below it)
    chat_template_sha256: str
    max_len: int
    inputs: list[str]
    samples_read: int = 0
    samples_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count
    truncated: int = 0
    total_tokens: int = 0
    supervised_tokens: int = 0
    min_tokens: int = 0
    mean_tokens: float = 0.0
    max_tokens: int = 0
    supervised_share: float = 0.0
    max_samples: int | None = None  # --max-samples: a random subset of the valid conversations
    seed: int = 0  # --seed of that subset
    not_selected: int = 0  # valid conversations left out by --max-samples
    drop_examples: dict[str, str] = field(default_factory=dict)  # reason -> first sample and detail
    # How conversations were rendered and what the kept samples supervise (see common/prepare/loss_mask.py).
    rendering: dict = field(default_factory=dict)  # template switches, generation prompts, policies
    supervised_turns: int = 0  # assistant turns with a loss
    reasoning_turns: int = 0  # ... of which keep their reasoning
    stripped_turns: int = 0  # turns with reasoning the template dropped: not supervised
    tool_calls: int = 0  # tool calls in supervised turns
    tool_calls_not_rendered: int = 0  # ... that the template leaves out of the text
    unlocated_turns: int = 0  # turns with no string of theirs in the text to place them by: not supervised
    tool_calls_skipped: dict[str, int] = field(default_factory=dict)  # malformed calls skipped, by reason
    tool_call_examples: dict[str, str] = field(default_factory=dict)  # reason -> first sample
    media_parts_dropped: int = 0  # image/audio/video content parts left out of the text (all read)
    target_digest: str = ""  # common/target/config.py: the target by what it is; "" in earlier versions
    format_version: int = FORMAT_VERSION

    def save(self, folder: str | Path) -> None:
        write_json(Path(folder) / REPORT_FILE, asdict(self))

    @classmethod
    def load(cls, folder: str | Path) -> PrepareReport:
        data = read_stage_report(Path(folder) / REPORT_FILE, FORMAT_VERSION,
                                 missing=f"prepared dataset {folder}: no {REPORT_FILE} (run 01_prepare_data.py first)")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def check_prepared_target(report: PrepareReport, folder: str | Path, target: str, target_vocab: int) -> None:
    """Refuse data tokenized for another target or tokenizer: its ids would index the wrong
    vocabulary or the wrong embeddings. Stages 02, 03 and 05 call this before any work."""
    if report.vocab_size != target_vocab:
        raise PipelineError(f"prepared dataset {folder} was made for a vocabulary of {report.vocab_size} "
                            f"(target {report.target}), but target {target} has {target_vocab}; "
                            "re-run 01_prepare_data.py with this target")
    if report.target_digest:  # the same checkpoint moved or copied elsewhere is the same target
        if report.target_digest != target_digest(target):
            raise PipelineError(f"prepared dataset {folder} was made with target {report.target}, not with the "
                                f"given target {target} (their config.json or weight index differ); re-run "
                                "01_prepare_data.py with this target")
    elif Path(report.target).resolve() != Path(target).resolve():
        raise PipelineError(f"prepared dataset {folder} was made with target {report.target}, "
                            f"not with the given target {target}; re-run 01_prepare_data.py with this target")


def _unreadable_shard(folder: Path) -> str | None:
    """The first Arrow data file of `folder` that pyarrow cannot read through, by name (None: all read)."""
    for path in sorted(folder.glob("*.arrow")):
        try:
            with pa.memory_map(str(path)) as source:
                pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowException):
            return path.name
    return None


def load_prepared(folder: str | Path):
    """(datasets.Dataset, PrepareReport) of a prepared folder, validated; errors name the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PipelineError(f"prepared dataset {folder}: no such folder (run 01_prepare_data.py first)")
    report = PrepareReport.load(folder)
    try:
        ds = load_from_disk(str(folder))
    except IndexError as e:  # datasets cannot load a dataset saved with no rows (no data shards)
        raise PipelineError(f"prepared dataset {folder}: it holds no samples (no data shards)") from e
    except (OSError, ValueError) as e:  # pyarrow's errors for a data file cut short name no file
        shard = _unreadable_shard(folder)
        if shard is not None:
            raise PipelineError(f"prepared dataset {folder}: {shard} cannot be read ({e}); run 01_prepare_data.py "
                                "again") from e
        raise PipelineError(f"prepared dataset {folder}: not a saved Hugging Face dataset: {e}") from e
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise PipelineError(f"prepared dataset {folder}: columns {missing} missing")
    if len(ds) == 0:
        raise PipelineError(f"prepared dataset {folder}: it holds no samples")
    return ds, report
