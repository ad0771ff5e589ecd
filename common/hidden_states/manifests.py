"""The shard manifests of a hidden-state folder, their check against a run, and their merge into
`sample_lengths.json` and `data_config.json`."""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path

from common.atomic import (
    read_json,
    write_json,
)
from common.errors import PipelineError
from common.hidden_states.data_config import (
    DATA_CONFIG,
    SAMPLE_LENGTHS,
    DataConfig,
)
from common.hidden_states.state_files import (
    list_sample_files,
    sample_file_names,
)

MANIFEST_RE = re.compile(r"extract_shard_(\d+)_of_(\d+)\.json")


def manifest_path(root: str | Path, shard_index: int, num_shards: int) -> Path:
    return Path(root) / f"extract_shard_{shard_index}_of_{num_shards}.json"


def check_output_folder(root: Path, config: DataConfig) -> None:
    """Refuse a folder holding files of another target or layer choice, before touching it."""
    manifests = sorted(p for p in root.glob("extract_shard_*.json") if MANIFEST_RE.fullmatch(p.name))
    sources = [root / DATA_CONFIG, *manifests]
    found_any = False
    for source in sources:
        if not source.is_file():
            continue
        try:
            data = read_json(source)
            theirs = DataConfig.from_dict(data.get("config", data)).identity()
        except (ValueError, TypeError, KeyError) as e:
            raise PipelineError(f"output folder {root}: cannot read {source.name} ({e}); use another --output") from e
        found_any = True
        for key, ours in config.identity().items():
            if theirs[key] != ours:
                raise PipelineError(
                    f"output folder {root} holds hidden states of another target or layer or storage choice "
                    f"({key} {theirs[key]} in {source.name}, {ours} now); use another --output or delete the folder")
    if not found_any and any(root.rglob("data_*.pt")):
        raise PipelineError(f"output folder {root} holds data files but no {DATA_CONFIG}: it was not written by "
                            "this step; use another --output")


def write_manifest(path: Path, config: DataConfig, lengths: dict[int, int], failed: list[dict],
                   finished: bool) -> None:
    write_json(path, {"config": asdict(config), "finished": finished, "failed": failed,
                      "lengths": {str(i): n for i, n in sorted(lengths.items())}})


def merge_manifests(root: Path, num_shards: int) -> DataConfig | None:
    """Write `sample_lengths.json` and `data_config.json` when every shard of the run has
    finished; return the merged config, or None while some shard is still running."""
    manifests = []
    for j in range(num_shards):
        path = manifest_path(root, j, num_shards)
        if not path.is_file():
            return None
        manifests.append(read_json(path))
    if not all(m["finished"] for m in manifests):
        return None
    # Entries of an earlier run (e.g. a larger --max-samples) stay as long as their file does.
    old = root / SAMPLE_LENGTHS
    lengths = {int(i): n for i, n in read_json(old).items()} if old.is_file() else {}
    for m in manifests:
        lengths.update({int(i): n for i, n in m["lengths"].items()})
    on_disk = list_sample_files(root)
    lengths = {i: n for i, n in sorted(lengths.items()) if i in on_disk}
    config = DataConfig.from_dict(manifests[0]["config"])
    config.num_shards = num_shards
    config.sample_count = len(lengths)
    config.token_count = sum(lengths.values())
    config.bytes_total = sum(on_disk[i].stat().st_size for i in lengths)
    config.failed = sorted((f for m in manifests for f in m["failed"] if f["index"] not in lengths),
                           key=lambda f: f["index"])
    write_json(root / SAMPLE_LENGTHS, {str(i): n for i, n in lengths.items()})
    config.save(root)
    return config


def remove_stale_rows(root: Path, config: DataConfig, num_rows: int) -> int:
    """When the folder was last written from another prepared dataset (01 was run again), delete
    the files of rows past this dataset's end and forget the merged lists: they belong to rows
    that no longer exist, which 04 would train on and 05 index past the end. Rows within range
    are checked against their prepared row as on any resume. Returns the files deleted."""
    if not (root / DATA_CONFIG).is_file():
        return 0
    previous = DataConfig.from_dict(read_json(root / DATA_CONFIG)).prepared_fingerprint
    if previous == config.prepared_fingerprint:
        return 0
    stale = [path for i, path in sample_file_names(root).items() if i >= num_rows]
    for path in stale:
        os.unlink(path)
    (root / SAMPLE_LENGTHS).unlink(missing_ok=True)  # the merge starts from this run's manifests
    return len(stale)
