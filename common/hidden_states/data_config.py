"""The hidden-state folder written by step 02 and read by step 04.

Layout (speculators' v1 sample format; every field in docs/FILES.md):

    OUT/00000/data_0.pt ... OUT/00049/data_499999.pt   one file per prepared row i, grouped
                                                      by i // 10000 to keep folders small
    OUT/extract_shard_{j}_of_{k}.json                 one manifest per shard (identity, lengths,
                                                      failed samples, finished flag)
    OUT/extract_journal_{j}_of_{k}.txt                the files each shard has finished (size, ids
                                                      digest): the resume scan reads it, not the files
    OUT/sample_lengths.json                           {"i": S} of every data file in the folder
    OUT/data_config.json                              DataConfig: what produced the files

Each `data_{i}.pt` is `{"input_ids": int64[S], "hidden_states": [bf16[S, H]] * 4,
"loss_mask": int64[S]}`: three auxiliary layers (ids in the vLLM convention), then the
post-norm final state. With `--storage fp8` the states are float8 e4m3 and the file also holds
`"hidden_state_scales": bf16[4, S]` (common/hidden_states/storage.py). Files are written under a
temporary name and renamed, so a file under its final name is complete.

Several shards may write into one folder at once. Each keeps its own manifest; whichever shard
finishes last (it sees every manifest of its run marked finished) merges them into
`sample_lengths.json` and `data_config.json`. A merge lists exactly the data files present on
disk, so the two files are consistent with the folder whenever they are written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

import torch

from common.atomic import read_stage_report, write_json
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES, StateStorage
from common.prepare.fingerprints import prepared_fingerprint
from common.prepare.prepared_dataset import PrepareReport
from common.target.config import TargetInfo

FORMAT_VERSION = 1
DATA_FORMAT = "speculators-v1"
LAST_STATE = "post_norm"  # the final state is the input of lm_head (HF hidden_states[N])
NUM_STATES = 4  # three auxiliary layers, then the final state
FILES_PER_FOLDER = 10_000
DATA_CONFIG = "data_config.json"
SAMPLE_LENGTHS = "sample_lengths.json"
IDENTITY_FIELDS = ("architecture", "text_architecture", "hidden_size", "num_layers", "vocab_size",
                   "layer_ids", "last_state", "storage", "dtype", "format_version")
PACKAGES = ("torch", "transformers", "speculators", "datasets")


@dataclass
class DataConfig:
    """`data_config.json`: the target and choices behind a hidden-state folder, and its counts."""

    target: str
    architecture: str
    text_architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_ids: list[int]  # auxiliary layers, vLLM convention (HF hidden_states[i])
    compute_dtype: str
    max_len: int
    prepared: str
    tokenizer: str
    chat_template_sha256: str
    last_state: str = LAST_STATE
    storage: str = DEFAULT_STORAGE  # "bf16" or "fp8" (common/hidden_states/storage.py); absent in older folders: bf16
    dtype: str = "bfloat16"  # dtype of the stored hidden states
    scales: str | None = None  # where the fp8 scales are, per token row of each state
    package_versions: dict[str, str] = field(default_factory=dict)
    num_shards: int = 1
    sample_count: int = 0
    token_count: int = 0
    bytes_total: int = 0
    failed: list[dict] = field(default_factory=list)  # {"index", "sample_id", "error"}
    data_format: str = DATA_FORMAT
    format_version: int = FORMAT_VERSION
    prepared_fingerprint: str = ""  # common/prepare/fingerprints.py; "" in folders of earlier versions

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in IDENTITY_FIELDS}

    def save(self, folder: str | Path) -> None:
        write_json(Path(folder) / DATA_CONFIG, asdict(self))

    @classmethod
    def from_dict(cls, data: dict) -> DataConfig:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @classmethod
    def load(cls, folder: str | Path) -> DataConfig:
        return cls.from_dict(read_stage_report(
            Path(folder) / DATA_CONFIG, FORMAT_VERSION,
            missing=f"hidden states {folder}: no {DATA_CONFIG} (run 02_extract_hidden_states.py first)"))


def package_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in PACKAGES}


def new_data_config(info: TargetInfo, layer_ids: list[int], compute_dtype: torch.dtype, prepared: Path,
                    report: PrepareReport, storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> DataConfig:
    scales = "hidden_state_scales: bfloat16[4, S], one per token row of each state" if storage.scaled else None
    return DataConfig(
        target=info.path, architecture=info.architecture, text_architecture=info.text_architecture,
        hidden_size=info.hidden_size, num_layers=info.num_layers, vocab_size=info.vocab_size,
        layer_ids=list(layer_ids), compute_dtype=str(compute_dtype).removeprefix("torch."),
        max_len=report.max_len, prepared=str(Path(prepared).resolve()), tokenizer=report.tokenizer,
        chat_template_sha256=report.chat_template_sha256, storage=storage.name, dtype=storage.dtype_name,
        scales=scales, package_versions=package_versions(), prepared_fingerprint=prepared_fingerprint(prepared))


# --- sample files -------------------------------------------------------------------------
