"""common/hidden_states/loader.py: the hidden-state folder checks, the split and the library's loader."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import write_hidden_states
from speculators.train.data import list_files

from common.errors import PipelineError
from common.hidden_states.loader import load_hidden_states, split_data
from common.hidden_states.state_files import sample_index
from common.train.settings import TrainSettings


def test_fp8_folder_with_bf16_files_is_refused(tmp_path, kimi_target):
    data_dir = write_hidden_states(tmp_path / "hs", kimi_target, num_samples=3)
    config = json.loads((data_dir / "data_config.json").read_text())
    (data_dir / "data_config.json").write_text(json.dumps(config | {"storage": "fp8", "dtype": "float8_e4m3fn"}))
    with pytest.raises(PipelineError, match="expected 4 float8_e4m3fn states of hidden size 64 with their scales"):
        load_hidden_states(data_dir)


def test_the_split_follows_split_seed_not_seed(tmp_path, flat_target):
    """Runs of other `--seed`s hold out the same rows (so their drafts are measured on the same
    prompts); `--split-seed` draws another split."""
    data = load_hidden_states(write_hidden_states(tmp_path / "hs", flat_target, num_samples=20))
    train, val = split_data(data, TrainSettings(val_ratio=0.25))
    assert len(val) == 5 and sorted(train + val) == sorted(data.files)
    assert split_data(data, TrainSettings(val_ratio=0.25, seed=1)) == (train, val)
    other_train, other_val = split_data(data, TrainSettings(val_ratio=0.25, split_seed=1))
    assert set(other_val) != set(val) and sorted(other_train + other_val) == sorted(data.files)


def test_the_split_is_the_same_whatever_order_the_folder_lists(tmp_path, flat_target):
    """The same files listed in other orders (tmpfs lists in reverse creation order, ext4 in hash
    order) hold out the same rows: a run folder copied to another disk resumes on its own split."""
    data_dir = write_hidden_states(tmp_path / "hs", flat_target, num_samples=20)
    files = sorted(p.relative_to(data_dir) for p in data_dir.rglob("*") if p.is_file())
    copies = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:  # tmpfs lists in reverse creation order
        for name, order in (("up", files), ("down", files[::-1])):
            for file in order:
                (Path(shm) / name / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(data_dir / file, Path(shm) / name / file)
            copies.append(load_hidden_states(Path(shm) / name))
        assert [f.name for f in list_files(copies[0].folder)] != [f.name for f in list_files(copies[1].folder)]
        splits = [split_data(data, TrainSettings(val_ratio=0.25)) for data in (load_hidden_states(data_dir), *copies)]
    rows = [([sample_index(f) for f in train], [sample_index(f) for f in val]) for train, val in splits]
    assert rows[0] == rows[1] == rows[2] and len(rows[0][1]) == 5
