"""common/prepare/fingerprints.py: the prepared dataset's fingerprint follows its report and its
content, a missing file is named, and outputs of two different runs of 01 are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import PipelineError
from common.prepare.fingerprints import check_same_prepared, prepared_fingerprint


def _prepared(folder: Path, report: str = '{"samples_kept": 2}', state: str = '{"_fingerprint": "abc"}') -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prepare_report.json").write_text(report)
    (folder / "state.json").write_text(state)
    return folder


def test_fingerprint_follows_report_and_content(tmp_path):
    first = prepared_fingerprint(_prepared(tmp_path / "a"))
    assert len(first) == 16 and int(first, 16) >= 0
    assert prepared_fingerprint(_prepared(tmp_path / "b")) == first  # same files, same fingerprint
    assert prepared_fingerprint(_prepared(tmp_path / "c", state='{"_fingerprint": "abd"}')) != first
    assert prepared_fingerprint(_prepared(tmp_path / "d", report='{"samples_kept": 3}')) != first


@pytest.mark.parametrize("missing", ["prepare_report.json", "state.json"])
def test_missing_file_is_named(tmp_path, missing):
    folder = _prepared(tmp_path / "p")
    (folder / missing).unlink()
    with pytest.raises(PipelineError, match=f"prepared dataset {folder}: no {missing}"):
        prepared_fingerprint(folder)


def test_outputs_of_different_runs_are_refused():
    hidden, vocab = ("hidden states", "/run/hidden_states"), ("vocabulary", "/run/vocab")
    check_same_prepared(hidden, vocab, ("1" * 16, "1" * 16))
    check_same_prepared(hidden, vocab, ("", "2" * 16))  # an output of an earlier version: not checked
    with pytest.raises(PipelineError, match=r"hidden states /run/hidden_states and vocabulary /run/vocab come from "
                                            r"different runs of 01_prepare_data\.py \(prepared fingerprints 1{16} "
                                            r"and 2{16}\)"):
        check_same_prepared(hidden, vocab, ("1" * 16, "2" * 16))
