"""04 --online --max-disk SIZE: the states of the rows computed first kept as ordinary 02 files in
RUN/hidden_states/ until SIZE is used (`KeptStates`); later epochs read those files, and 02, 04 and
05 read the folder as one of 02's. A folder of another prepared dataset is refused
(`check_same_prepared_rows`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.atomic import format_bytes, read_json
from common.errors import PipelineError
from common.extract.batches import estimate_bytes
from common.extract.run import Sample
from common.hidden_states.data_config import DATA_CONFIG, NUM_STATES, DataConfig
from common.hidden_states.manifests import check_output_folder, manifest_path, merge_manifests, write_manifest
from common.hidden_states.state_files import list_sample_files, sample_path, save_sample
from common.hidden_states.storage import StateStorage, StoredStates, get_storage


class KeptStates:
    """`--max-disk`: the states of the first rows computed, kept as 02's files in `folder` while the
    bytes there (files found at the start included) stay within `limit`, split evenly over the ranks;
    one manifest per rank (written at the start, so a killed run's folder reads as 02's on resume),
    merged into 02's `sample_lengths.json` and `data_config.json` at the end of each pass (`publish`).
    A folder of another target, layer choice, storage or prepared dataset is refused."""

    def __init__(self, folder: Path, config: DataConfig, limit: int, lengths: dict[int, int], rank: int,
                 world_size: int) -> None:
        self.folder, self.config, self.limit = folder, config, limit // world_size
        self.rank, self.world_size = rank, world_size
        self.kept: dict[int, int] = {}  # row -> tokens
        self.used = 0
        if folder.is_dir():
            check_output_folder(folder, config)
            check_same_prepared_rows(folder, config)
            per_token = get_storage(config.storage).bytes_per_token(NUM_STATES, config.hidden_size)
            for row, path in list_sample_files(folder).items():
                size = path.stat().st_size
                if row in lengths and size >= lengths[row] * per_token:  # shorter: cut short, computed again
                    self.kept[row], self.used = lengths[row], self.used + size // world_size
        folder.mkdir(parents=True, exist_ok=True)
        write_manifest(self.manifest, config, dict(self.kept), [], finished=False)

    @property
    def manifest(self) -> Path:
        return manifest_path(self.folder, self.rank, self.world_size)

    def keep(self, sample: Sample, stored: StoredStates, storage: StateStorage) -> None:
        """Write the sample's file if it fits in what is left of the budget (another rank may have
        written it already: then it is only listed)."""
        n = len(sample.input_ids)
        if sample.index in self.kept:
            return
        if sample_path(self.folder, sample.index).is_file():
            self.kept[sample.index] = n
            return
        if self.used + estimate_bytes(n, 1, self.config.hidden_size, storage) > self.limit:
            return
        self.used += save_sample(self.folder, sample.index, torch.tensor(sample.input_ids, dtype=torch.long),
                                 stored.states, torch.tensor(sample.loss_mask, dtype=torch.long), stored.scales)
        self.kept[sample.index] = n

    def publish(self) -> None:
        write_manifest(self.manifest, self.config, dict(self.kept), [], finished=True)
        merge_manifests(self.folder, self.world_size)

    def describe(self) -> str:
        return (f"{len(self.kept):,} samples kept in {self.folder} ({format_bytes(self.used)} of the "
                f"--max-disk {format_bytes(self.limit)})")


def check_same_prepared_rows(folder: Path, config: DataConfig) -> None:
    """Kept files are read as the rows of this prepared dataset: a folder written from another one
    (01 run again) is refused rather than trained on."""
    sources = [folder / DATA_CONFIG, *sorted(folder.glob("extract_shard_*.json"))]
    for source in (p for p in sources if p.is_file()):
        data = read_json(source)
        theirs = data.get("config", data).get("prepared_fingerprint")
        if theirs and theirs != config.prepared_fingerprint:
            raise PipelineError(f"{folder} holds hidden states of another prepared dataset ({source.name}: prepared "
                                f"fingerprint {theirs}, now {config.prepared_fingerprint}); move it away for "
                                "--max-disk to keep this run's states there")
