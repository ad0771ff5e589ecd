"""common/hidden_states/state_files.py: a sample's file name (grouped by 10,000 per folder) and back,
a saved sample checked against its prepared row, the folder's listing (any other `*pt` file refused:
speculators' dataset would load it), and the temporaries of a killed shard removed without touching
another shard's."""

from __future__ import annotations

import pytest
import torch

from common.atomic import TMP_PREFIX
from common.errors import PipelineError
from common.hidden_states.state_files import (
    is_valid_sample,
    list_sample_files,
    remove_own_temporaries,
    sample_index,
    sample_path,
    save_sample,
)

HIDDEN = 8


def save(root, index: int, ids: list[int]) -> int:
    n = len(ids)
    states = [torch.randn(n, HIDDEN).to(torch.bfloat16) for _ in range(4)]
    return save_sample(root, index, torch.tensor(ids), states, torch.ones(n, dtype=torch.long))


def test_file_names_are_grouped_by_ten_thousand_and_parse_back(tmp_path):
    assert sample_path(tmp_path, 7) == tmp_path / "00000" / "data_7.pt"
    assert sample_path(tmp_path, 123_456) == tmp_path / "00012" / "data_123456.pt"
    for index in (0, 9_999, 10_000, 123_456):
        assert sample_index(sample_path(tmp_path, index)) == index
    for other in ("t2d.pt", "data_7.pt.tmp", "data_x.pt", f"{TMP_PREFIX}data_7.pt.a1b2.tmp"):
        assert sample_index(other) is None


def test_a_saved_sample_is_valid_for_its_own_row_only(tmp_path):
    size = save(tmp_path, 3, [5, 6, 7])
    path = sample_path(tmp_path, 3)
    assert size == path.stat().st_size
    assert is_valid_sample(path, [5, 6, 7], HIDDEN)
    assert not is_valid_sample(path, [5, 6, 8], HIDDEN)  # the row was prepared again with other ids
    assert not is_valid_sample(path, [5, 6, 7], 2 * HIDDEN)  # states of another target
    path.write_bytes(path.read_bytes()[:-50])  # cut short
    assert not is_valid_sample(path, [5, 6, 7], HIDDEN)
    assert not is_valid_sample(tmp_path / "missing.pt", [5, 6, 7], HIDDEN)


def test_the_listing_finds_every_folder_and_refuses_a_foreign_pt_file(tmp_path):
    for index in (1, 10_002, 25_000):
        save(tmp_path, index, [1, 2])
    (tmp_path / "sample_lengths.json").write_text("{}")  # not a *pt file: ignored
    assert list_sample_files(tmp_path) == {i: sample_path(tmp_path, i) for i in (1, 10_002, 25_000)}
    torch.save({}, tmp_path / "00001" / "t2d.pt")
    with pytest.raises(PipelineError, match=rf"output folder {tmp_path} holds {tmp_path / '00001' / 't2d.pt'}, "
                                            "which is not a hidden-state file"):
        list_sample_files(tmp_path)


def test_a_shard_removes_its_own_temporaries_only(tmp_path):
    """Another shard writing into the same folder keeps its temporaries: they are files in the making."""
    save(tmp_path, 2, [1, 2])  # a finished file under its final name stays
    mine = [sample_path(tmp_path, 2).with_name(f"{TMP_PREFIX}data_2.pt.x81k.tmp"),
            sample_path(tmp_path, 10_004).with_name(f"{TMP_PREFIX}data_10004.pt.0q1z.tmp"),
            tmp_path / f"{TMP_PREFIX}extract_shard_0_of_2.json.k2m.tmp"]
    theirs = [sample_path(tmp_path, 3).with_name(f"{TMP_PREFIX}data_3.pt.p0e1.tmp"),
              tmp_path / f"{TMP_PREFIX}extract_shard_1_of_2.json.zz1.tmp"]
    for path in mine + theirs:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"partial")
    assert remove_own_temporaries(tmp_path, {0, 2, 10_004}, tmp_path / "extract_shard_0_of_2.json") == 3
    assert not any(path.exists() for path in mine)
    assert all(path.exists() for path in theirs) and sample_path(tmp_path, 2).exists()
