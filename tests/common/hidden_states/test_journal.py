"""common/hidden_states/journal.py: the journal of finished files and the resume scan: what a plain
restart trusts unopened, what it loads and checks, and what --verify re-reads."""

from __future__ import annotations

import torch
from datasets import Dataset

from common.hidden_states import journal
from common.hidden_states.journal import Journal, find_done, ids_digest, journal_path, read_journals
from common.hidden_states.state_files import file_digest, is_valid_sample, sample_path, save_sample

HIDDEN = 8
ROWS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]


def write_journaled(root) -> Dataset:
    with Journal(journal_path(root, 0, 1)) as journal:
        for i, ids in enumerate(ROWS):
            n = len(ids)
            states = [torch.full((n, HIDDEN), float(i), dtype=torch.bfloat16)] * 4
            size = save_sample(root, i, torch.tensor(ids), states, torch.ones(n, dtype=torch.long))
            journal.add(i, size, ids_digest(ids), file_digest(sample_path(root, i)) if i != 3 else "")
    return Dataset.from_dict({"input_ids": ROWS})


def damage_state_bytes(path) -> None:
    """One byte of the stored states changed, the size kept: the file still loads."""
    data = bytearray(path.read_bytes())
    at = data.find(bytes(torch.full((4,), 2.0, dtype=torch.bfloat16).view(torch.uint8)))
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_verify_redoes_a_file_damaged_in_place_and_a_plain_restart_does_not_open_it(tmp_path, monkeypatch):
    ds = write_journaled(tmp_path)
    damage_state_bytes(sample_path(tmp_path, 2))
    assert torch.load(sample_path(tmp_path, 2), weights_only=True)["hidden_states"][0].float().mean() != 2.0
    loaded = []
    original = is_valid_sample
    monkeypatch.setattr(journal, "is_valid_sample", lambda path, *a: loaded.append(path.name) or original(path, *a))
    assert find_done(tmp_path, ds, set(range(4)), HIDDEN) == ({0, 1, 2, 3}, 0) and loaded == []
    done, redo = find_done(tmp_path, ds, set(range(4)), HIDDEN, verify=True)
    assert (done, redo) == ({0, 1, 3}, 1)
    assert not sample_path(tmp_path, 2).exists()
    assert loaded == ["data_3.pt"]  # journaled without a digest (an earlier version): loaded and checked


def test_a_journal_with_bytes_that_are_not_utf8_is_read_around_them(tmp_path):
    ds = write_journaled(tmp_path)
    path = journal_path(tmp_path, 0, 1)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = b"1 \xff\xfe garbled\n"
    path.write_bytes(b"".join(lines))
    journal = read_journals(tmp_path)
    assert sorted(journal) == [0, 2, 3]
    assert find_done(tmp_path, ds, set(range(4)), HIDDEN) == ({0, 1, 2, 3}, 0)  # row 1 loaded and checked


def test_resume_scan_trusts_the_journal_and_checks_the_rest(tmp_path, monkeypatch):
    """Journaled files with their recorded size and ids are kept unopened; a file cut short, a
    file of other ids, and a file the journal never heard of are loaded and checked."""
    hidden = 8
    rows = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    ds = Dataset.from_dict({"input_ids": rows})
    journal = Journal(journal_path(tmp_path, 0, 1))
    for i, ids in enumerate(rows):
        n = len(ids)
        size = save_sample(tmp_path, i, torch.tensor(ids), [torch.zeros(n, hidden, dtype=torch.bfloat16)] * 4,
                           torch.ones(n, dtype=torch.long))
        if i != 3:  # row 3: killed between its file and its journal line
            journal.add(i, size, ids_digest(ids))
    journal.file.write("4 12")  # a line cut short by the kill
    journal.close()
    truncated = sample_path(tmp_path, 1)
    truncated.write_bytes(truncated.read_bytes()[:100])
    changed = ds.map(lambda r, i: {"input_ids": [99] * len(r["input_ids"]) if i == 2 else r["input_ids"]},
                     with_indices=True)  # row 2 re-prepared with other ids

    loaded = []
    original = is_valid_sample
    monkeypatch.setattr("common.hidden_states.journal.is_valid_sample",
                        lambda path, *a: loaded.append(path.name) or original(path, *a))
    done, redo = find_done(tmp_path, changed, set(range(len(rows))), hidden)
    assert done == {0, 3, 4} and redo == 2
    assert sorted(loaded) == ["data_1.pt", "data_2.pt", "data_3.pt"]
    assert not sample_path(tmp_path, 1).exists() and not sample_path(tmp_path, 2).exists()
