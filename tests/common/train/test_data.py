"""common/train/data.py: the hidden-state folder checks and the library's loader."""

from __future__ import annotations

import json

import pytest
from conftest import write_hidden_states

from common.errors import PipelineError
from common.train.data import load_hidden_states


def test_fp8_folder_with_bf16_files_is_refused(tmp_path, kimi_target):
    data_dir = write_hidden_states(tmp_path / "hs", kimi_target, num_samples=3)
    config = json.loads((data_dir / "data_config.json").read_text())
    (data_dir / "data_config.json").write_text(json.dumps(config | {"storage": "fp8", "dtype": "float8_e4m3fn"}))
    with pytest.raises(PipelineError, match="expected 4 float8_e4m3fn states of hidden size 64 with their scales"):
        load_hidden_states(data_dir)
