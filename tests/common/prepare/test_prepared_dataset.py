"""A prepared dataset is tied to its target by what the target is, not by where it lies."""

from __future__ import annotations

import json
import shutil

import pytest

from common.errors import PipelineError
from common.prepare.prepared_dataset import PrepareReport, check_prepared_target
from common.target.config import load_target_info, target_digest


def report_for(target) -> PrepareReport:
    info = load_target_info(target)
    return PrepareReport(target=info.path, tokenizer="T", vocab_size=info.vocab_size, chat_template_sha256="0",
                         max_len=8, inputs=[], target_digest=target_digest(target))


def test_a_moved_target_is_the_same_and_another_checkpoint_is_not(tmp_path, flat_target):
    report = report_for(flat_target)
    moved = shutil.copytree(flat_target, tmp_path / "other_disk" / "flat")
    check_prepared_target(report, tmp_path, str(moved), report.vocab_size)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-3}))
    with pytest.raises(PipelineError, match="was made with target .*, not with the given target .*other_disk/flat "
                                            r"\(their config\.json or weight index differ\)"):
        check_prepared_target(report, tmp_path, str(moved), report.vocab_size)
