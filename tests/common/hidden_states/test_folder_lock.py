"""common/hidden_states/folder_lock.py: a 02 shard holds its lock on the output folder while it
writes; a second writer of the same shard is refused, naming the folder and the holder; the lock
file goes at the end; and the disk check refuses a disk too small for the estimate."""

from __future__ import annotations

import os
import shutil

import pytest

from common.errors import PipelineError
from common.hidden_states.folder_lock import LOCK_FORMAT, check_disk, shard_lock


def test_a_second_writer_of_the_same_shard_is_refused_naming_the_folder_and_the_holder(tmp_path):
    with shard_lock(tmp_path, 0, 2):
        lock = tmp_path / LOCK_FORMAT.format(shard=0, shards=2)
        assert f"pid {os.getpid()}" in lock.read_text()
        with pytest.raises(PipelineError, match=rf"^output folder {tmp_path}: 02_extract_hidden_states\.py "
                                                rf"\(pid {os.getpid()} on .*\) is writing shard 0 of 2 into it; "
                                                "wait for it to finish"):
            with shard_lock(tmp_path, 0, 2):
                pass
        with shard_lock(tmp_path, 1, 2):  # the other shard of the run writes beside it
            pass
        with pytest.raises(PipelineError, match="is writing shard 0 of 2"):  # the refusal left the lock held
            with shard_lock(tmp_path, 0, 2):
                pass
    assert not lock.exists()
    with shard_lock(tmp_path, 0, 2):  # released: the next run takes it
        assert lock.exists()


def test_the_lock_is_released_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError, match="the run failed"), shard_lock(tmp_path, 0, 1):
        raise RuntimeError("the run failed")
    assert not list(tmp_path.iterdir())
    with shard_lock(tmp_path, 0, 1):
        pass


def test_the_disk_check_refuses_more_than_the_free_space(tmp_path):
    out = tmp_path / "not" / "made" / "yet"  # the disk of its nearest existing parent is asked
    free = shutil.disk_usage(tmp_path).free
    check_disk(out, 0)
    with pytest.raises(PipelineError, match=rf"^output disk of {out} has .* free, the samples still to extract need "
                                            r"about .*; free space, choose another --output, or pass --skip-disk-check"):
        check_disk(out, 2 * free + (1 << 40))
    assert not out.exists()
