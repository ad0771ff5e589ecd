"""common/train/checkpoints.py: the resume point, step-checkpoint pruning, the packing check and
the RNG state round trip (04's end-to-end resume tests are in tests/test_04_train.py)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from common.atomic import read_json, write_json
from common.errors import PipelineError
from common.train import checkpoints


def write_position(folder: Path, position: checkpoints.Position) -> Path:
    folder.mkdir(parents=True)
    checkpoints.write_state(folder, position, rank=0)
    return folder


def test_latest_checkpoint_is_the_furthest_step(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoints.latest(root) is None
    write_position(root / "0", checkpoints.Position(0, 32, 32, True))
    write_position(root / "steps" / "30", checkpoints.Position(0, 30, 30, False))
    point = checkpoints.latest(root)
    assert (point.folder.name, point.epoch, point.skip_batches) == ("0", 1, 0)  # the later epoch end wins
    write_position(root / "steps" / "40", checkpoints.Position(1, 8, 40, False))
    point = checkpoints.latest(root)
    assert (point.folder.name, point.epoch, point.skip_batches) == ("40", 1, 8)
    (root / "1").mkdir()  # an epoch checkpoint of an earlier version: no position, continue after it
    assert checkpoints.latest(root).folder.name == "40"  # unknown step loses to a known one
    write_position(root / "steps" / "45", checkpoints.Position(1, 13, 45, False))
    checkpoints.prune_steps(root, keep=2)
    assert checkpoints.numbered(root / "steps") == [40, 45]


def test_mid_epoch_position_of_another_packing_is_refused(tmp_path):
    folder = write_position(tmp_path / "steps" / "40", checkpoints.Position(1, 8, 40, False, 32, 2))
    point = checkpoints.ResumePoint(folder, checkpoints.read_position(folder))
    checkpoints.check_resumable(point, 32, 2)
    with pytest.raises(PipelineError, match=r"step checkpoint .*40 was taken with 32 batches per epoch on 2 rank\(s\), "
                                            r"this run has 16 on 4"):
        checkpoints.check_resumable(point, 16, 4)


def test_checkpoint_of_the_listing_order_split_is_named_on_resume(tmp_path):
    """Checkpoints written before the split by prepared row (format 1, or none) held out rows in the
    folder's listing order: a resumed run is told its validation rows may differ."""
    folder = write_position(tmp_path / "0", checkpoints.Position(0, 4, 4, True))
    assert checkpoints.split_warning(checkpoints.ResumePoint(folder, checkpoints.read_position(folder))) is None
    state = read_json(folder / checkpoints.STATE_FILE)
    write_json(folder / checkpoints.STATE_FILE, state | {"format": 1})
    for point in (checkpoints.ResumePoint(folder, checkpoints.read_position(folder)),
                  checkpoints.ResumePoint(tmp_path / "1", None)):  # an earlier version's: no state at all
        warning = checkpoints.split_warning(point)
        assert warning.startswith(f"warning: checkpoint {point.folder} was written before 04 split the data by "
                                  "prepared row")


def test_a_setting_an_earlier_checkpoint_did_not_record_is_compared_with_what_it_trained_with(tmp_path):
    """Checkpoints from before --target-temperature trained at temperature 1: resuming one at another
    temperature would change the run from that step on, so it is refused like any recorded setting."""
    folder = write_position(tmp_path / "0", checkpoints.Position(0, 4, 4, True))
    state = read_json(folder / checkpoints.STATE_FILE)
    write_json(folder / checkpoints.STATE_FILE, state | {"settings": {"lr": 0.018, "epochs": 4}})
    point = checkpoints.ResumePoint(folder, checkpoints.read_position(folder))
    checkpoints.check_same_settings(point, {"lr": 0.018, "epochs": 6, "target_temperature": 1.0, "new_key": 3})
    with pytest.raises(PipelineError, match=r"--target-temperature 0\.5: checkpoint .*0 was trained with "
                                            r"target_temperature 1\.0, which a resumed run keeps"):
        checkpoints.check_same_settings(point, {"lr": 0.018, "target_temperature": 0.5})


def test_rng_state_round_trip(tmp_path):
    write_position(tmp_path / "c", checkpoints.Position(0, 1, 1, False))
    expected = torch.rand(3), random.random(), np.random.rand()
    torch.rand(5), random.random(), np.random.rand()  # move every generator on
    assert checkpoints.restore_rng(tmp_path / "c", rank=0)
    assert (torch.equal(torch.rand(3), expected[0]), random.random(), np.random.rand()) == (True, *expected[1:])
    assert not checkpoints.restore_rng(tmp_path / "c", rank=1)


def test_a_position_inside_an_accumulation_group_is_refused(tmp_path):
    """A step checkpoint ends an accumulation group: its batches done are a multiple of --grad-accum
    (an epoch checkpoint ends the epoch, whatever its last group)."""
    folder = write_position(tmp_path / "steps" / "5", checkpoints.Position(0, 10, 5, False, 31, 1))
    point = checkpoints.ResumePoint(folder, checkpoints.read_position(folder))
    for grad_accum in (1, 2, 5):
        checkpoints.check_accumulation(point, grad_accum)
    with pytest.raises(PipelineError, match=r"step checkpoint .*5 was taken after batch 10 of its epoch, inside a "
                                            r"group of --grad-accum 3"):
        checkpoints.check_accumulation(point, 3)
    end = write_position(tmp_path / "0", checkpoints.Position(0, 31, 11, True, 31, 1))
    checkpoints.check_accumulation(checkpoints.ResumePoint(end, checkpoints.read_position(end)), 3)
