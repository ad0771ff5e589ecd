"""Damaged hidden-state files are skipped and counted by the training data path, not fatal."""

from __future__ import annotations

import pytest
import torch
from helpers import write_hidden_states

from common.draft.model import TINY_CONFIG, read_config_file
from common.errors import MIN_SKIPPED_LIMIT, PipelineError
from common.hidden_states.loader import load_hidden_states, make_loader
from common.hidden_states.skip_damaged import SkipTally
from common.hidden_states.state_files import sample_path
from common.train.settings import TrainSettings

SEQ = 64  # one sample per batch (samples are 48..54 tokens long)


def settings(workers: int = 0) -> TrainSettings:
    values, _ = TrainSettings.resolve(read_config_file(TINY_CONFIG), {"total_seq_len": SEQ, "noise_std": 0.0,
                                                                       "num_workers": workers})
    return values


def damage_in_place(path) -> None:
    """Bytes of the zip's central directory overwritten, the size unchanged (what a bad disk
    sector or a torn copy does): torch.load fails."""
    data = bytearray(path.read_bytes())
    data[-200:-100] = b"\xff" * 100
    path.write_bytes(bytes(data))


def batches_of(folder, workers: int = 0) -> tuple[list[dict], SkipTally]:
    data = load_hidden_states(folder)
    loader = make_loader(data, sorted(data.files), settings(workers), 1, 0, train=False, pin_memory=False)
    return list(loader), loader.tally


@pytest.mark.parametrize("workers", [0, 1])
def test_a_file_damaged_in_place_is_skipped_and_named(tmp_path, flat_target, workers):
    folder = write_hidden_states(tmp_path / "hs", flat_target, num_samples=4, hidden=64)
    bad = sample_path(folder, 2)
    size = bad.stat().st_size
    damage_in_place(bad)
    assert bad.stat().st_size == size
    batches, tally = batches_of(folder, workers)
    assert list(tally.skipped) == [str(bad)]
    assert "cannot be loaded" in tally.skipped[str(bad)]
    assert len(batches) == 4  # the packing planned from sample_lengths.json is unchanged
    masks = [int(b["loss_mask"].sum()) for b in batches]
    assert masks.count(0) == 1 and all(m > 0 for i, m in enumerate(masks) if masks[i] != 0)
    assert all("skipped_file" not in b for b in batches)


def test_a_file_with_nan_or_another_length_is_skipped(tmp_path, flat_target, capsys):
    folder = write_hidden_states(tmp_path / "hs", flat_target, num_samples=4, hidden=64)
    nan, short = sample_path(folder, 1), sample_path(folder, 3)
    sample = torch.load(nan, weights_only=True)
    sample["hidden_states"][0][5, 7] = float("nan")
    torch.save(sample, nan)
    sample = torch.load(short, weights_only=True)
    torch.save({k: [s[:-2] for s in v] if k == "hidden_states" else v[:-2] for k, v in sample.items()}, short)
    _batches, tally = batches_of(folder)
    assert tally.skipped == {str(nan): "hidden_states holds values that are not finite",
                             str(short): tally.skipped[str(short)]}
    assert "expected (" in tally.skipped[str(short)] and "sample_lengths.json" in tally.skipped[str(short)]
    err = capsys.readouterr().err
    assert f"warning: skipped {nan}: hidden_states holds values that are not finite (1 of 4" in err


def test_a_file_cut_short_is_found_before_loading(tmp_path, flat_target):
    folder = write_hidden_states(tmp_path / "hs", flat_target, num_samples=4, hidden=64)
    cut = sample_path(folder, 0)  # the first file: the folder check goes on to the next one
    cut.write_bytes(cut.read_bytes()[:500])
    data = load_hidden_states(folder)
    assert list(data.unreadable) == [cut] and data.unreadable[cut].startswith("cut short (500 bytes")
    assert list(data.skip_tally().skipped) == [str(cut)]


def test_the_run_stops_past_the_limit():
    tally = SkipTally(100)
    for i in range(MIN_SKIPPED_LIMIT):
        tally.add(f"f{i}", "bad")
    tally.add("f0", "bad again")  # a file is counted once, whichever epoch meets it again
    with pytest.raises(PipelineError, match=rf"{MIN_SKIPPED_LIMIT + 1} of 100 hidden-state files could not be used "
                                            rf"\(more than the limit of {MIN_SKIPPED_LIMIT}\), the last x: worse"):
        tally.add("x", "worse")
