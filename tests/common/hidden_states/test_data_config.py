"""common/hidden_states/data_config.py: `data_config.json`, what produced a hidden-state folder. It
is read back as written; a folder of an earlier version (no storage, no prepared fingerprint) reads
as bf16; a missing file or another format version is refused naming it; the identity that decides
whether a folder may be written into is the target, layers and storage, not the counts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import write_prepared

from common.errors import PipelineError
from common.hidden_states.data_config import DATA_CONFIG, FORMAT_VERSION, DataConfig, new_data_config
from common.hidden_states.storage import STORAGES
from common.prepare.fingerprints import prepared_fingerprint
from common.prepare.prepared_dataset import PrepareReport
from common.target.config import load_target_info


def data_config(**changes) -> DataConfig:
    config = DataConfig(target="/targets/flat", architecture="LlamaForCausalLM", text_architecture="LlamaForCausalLM",
                        hidden_size=64, num_layers=8, vocab_size=4096, layer_ids=[2, 4, 5], compute_dtype="float32",
                        max_len=40, prepared="/runs/a/prepared", tokenizer="test", chat_template_sha256="0" * 64)
    return dataclasses.replace(config, **changes)


def test_a_saved_config_loads_as_written(tmp_path):
    config = data_config(sample_count=3, token_count=70, failed=[{"index": 1, "sample_id": "a", "error": "x"}],
                         package_versions={"torch": "2.9"}, prepared_fingerprint="0123456789abcdef")
    config.save(tmp_path)
    assert DataConfig.load(tmp_path) == config
    assert json.loads((tmp_path / DATA_CONFIG).read_text())["format_version"] == FORMAT_VERSION


def test_a_config_of_an_earlier_version_reads_as_bf16(tmp_path):
    written = {k: v for k, v in dataclasses.asdict(data_config()).items()
               if k not in ("storage", "dtype", "scales", "prepared_fingerprint")}
    (tmp_path / DATA_CONFIG).write_text(json.dumps({**written, "removed_field": 1}))
    loaded = DataConfig.load(tmp_path)
    assert (loaded.storage, loaded.dtype, loaded.scales, loaded.prepared_fingerprint) == ("bf16", "bfloat16", None, "")


def test_a_missing_config_or_another_format_version_is_refused(tmp_path):
    with pytest.raises(PipelineError, match=rf"^hidden states {tmp_path}: no {DATA_CONFIG} \(run "
                                            r"02_extract_hidden_states\.py first\)"):
        DataConfig.load(tmp_path)
    data_config(format_version=FORMAT_VERSION + 1).save(tmp_path)
    with pytest.raises(PipelineError, match=rf"{DATA_CONFIG}: format version {FORMAT_VERSION + 1}, "
                                            rf"expected {FORMAT_VERSION}"):
        DataConfig.load(tmp_path)


def test_the_identity_is_what_the_files_hold_not_how_many():
    ours = data_config().identity()
    assert data_config(sample_count=9, token_count=99, prepared="/elsewhere", max_len=80, num_shards=4).identity() == ours
    for change in ({"layer_ids": [1, 2, 3]}, {"hidden_size": 32}, {"storage": "fp8"}, {"vocab_size": 163840}):
        assert data_config(**change).identity() != ours, change


def test_a_new_config_records_the_target_the_prepared_rows_and_the_storage(flat_target, tmp_path):
    prepared = write_prepared(tmp_path / "prepared", flat_target, 3)
    info = load_target_info(flat_target)
    config = new_data_config(info, [2, 4, 5], torch.bfloat16, prepared, PrepareReport.load(prepared), STORAGES["fp8"])
    assert (config.target, config.hidden_size, config.num_layers, config.layer_ids) == (info.path, 64, 8, [2, 4, 5])
    assert (config.compute_dtype, config.storage, config.dtype) == ("bfloat16", "fp8", "float8_e4m3fn")
    assert "hidden_state_scales" in config.scales and config.max_len == 40
    assert config.prepared == str(Path(prepared).resolve()) and config.prepared_fingerprint == prepared_fingerprint(prepared)
    assert set(config.package_versions) == {"torch", "transformers", "speculators", "datasets"}
    bf16 = new_data_config(info, [2, 4, 5], torch.float32, prepared, PrepareReport.load(prepared))
    assert (bf16.storage, bf16.dtype, bf16.scales, bf16.compute_dtype) == ("bf16", "bfloat16", None, "float32")
