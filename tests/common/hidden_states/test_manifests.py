"""common/hidden_states/manifests.py: the shard manifests of a hidden-state folder merged into
`sample_lengths.json` and `data_config.json` once every shard has finished (listing exactly the files
on disk), a folder of another target or layer choice refused before it is touched, and the rows of an
earlier prepared dataset removed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from common.errors import PipelineError
from common.hidden_states.data_config import DATA_CONFIG, SAMPLE_LENGTHS, DataConfig
from common.hidden_states.manifests import (
    check_output_folder,
    manifest_path,
    merge_manifests,
    remove_stale_rows,
    write_manifest,
)
from common.hidden_states.state_files import list_sample_files, sample_path, save_sample

HIDDEN = 8


def data_config(**changes) -> DataConfig:
    config = DataConfig(target="/targets/flat", architecture="LlamaForCausalLM", text_architecture="LlamaForCausalLM",
                        hidden_size=HIDDEN, num_layers=8, vocab_size=4096, layer_ids=[2, 4, 5],
                        compute_dtype="float32", max_len=40, prepared="/runs/a/prepared", tokenizer="test",
                        chat_template_sha256="0" * 64, prepared_fingerprint="first")
    return dataclasses.replace(config, **changes)


def write_files(root, lengths: dict[int, int]) -> None:
    for i, n in lengths.items():
        save_sample(root, i, torch.arange(n), [torch.zeros(n, HIDDEN, dtype=torch.bfloat16)] * 4,
                    torch.ones(n, dtype=torch.long))


def failure(index: int) -> dict:
    return {"index": index, "sample_id": f"s{index}", "error": "out of memory"}


def test_the_merge_waits_for_every_shard_then_lists_the_files_on_disk(tmp_path):
    config = data_config()
    # An earlier run's list: row 6 still has its file, row 7's is gone.
    write_files(tmp_path, {6: 2})
    (tmp_path / SAMPLE_LENGTHS).write_text(json.dumps({"6": 2, "7": 9}))
    write_files(tmp_path, {0: 3, 2: 5})
    write_manifest(manifest_path(tmp_path, 0, 2), config, {0: 3, 2: 5}, [failure(4)], finished=True)
    assert merge_manifests(tmp_path, 2) is None  # shard 1 has not started
    write_files(tmp_path, {1: 4})
    write_manifest(manifest_path(tmp_path, 1, 2), config, {1: 4}, [], finished=False)
    assert merge_manifests(tmp_path, 2) is None  # shard 1 is still running
    assert json.loads((tmp_path / SAMPLE_LENGTHS).read_text()) == {"6": 2, "7": 9} and not (tmp_path / DATA_CONFIG).exists()

    write_files(tmp_path, {3: 2})
    write_manifest(manifest_path(tmp_path, 1, 2), config, {1: 4, 3: 2}, [failure(5), failure(1)], finished=True)
    merged = merge_manifests(tmp_path, 2)
    assert json.loads((tmp_path / SAMPLE_LENGTHS).read_text()) == {"0": 3, "1": 4, "2": 5, "3": 2, "6": 2}
    assert (merged.num_shards, merged.sample_count, merged.token_count) == (2, 5, 16)
    assert merged.bytes_total == sum(path.stat().st_size for path in list_sample_files(tmp_path).values())
    assert [f["index"] for f in merged.failed] == [4, 5]  # row 1 failed once, and its file is there now
    assert DataConfig.load(tmp_path) == merged and merged.identity() == config.identity()


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_ids": [1, 2, 3]}, r"layer_ids \[2, 4, 5\] in data_config\.json, \[1, 2, 3\] now"),
    ({"storage": "fp8", "dtype": "float8_e4m3fn"}, "storage bf16 in data_config.json, fp8 now"),
    ({"hidden_size": 16}, "hidden_size 8 in data_config.json, 16 now"),
])
def test_a_folder_of_another_choice_is_refused_naming_the_difference(tmp_path, change, message):
    data_config().save(tmp_path)
    check_output_folder(tmp_path, data_config(prepared="/runs/b/prepared", max_len=80))  # not part of the identity
    with pytest.raises(PipelineError, match=rf"^output folder {tmp_path} holds hidden states of another target or "
                                            rf"layer or storage choice \({message}\); use another --output"):
        check_output_folder(tmp_path, data_config(**change))


def test_a_shard_manifest_alone_identifies_the_folder(tmp_path):
    """Shards still running (no data_config.json yet) keep their folder from another run's choice."""
    write_manifest(manifest_path(tmp_path, 1, 4), data_config(), {}, [], finished=False)
    check_output_folder(tmp_path, data_config())
    with pytest.raises(PipelineError, match=r"layer_ids \[2, 4, 5\] in extract_shard_1_of_4\.json"):
        check_output_folder(tmp_path, data_config(layer_ids=[3, 4, 5]))
    manifest_path(tmp_path, 1, 4).write_text(json.dumps({"config": {"layer_ids": [2, 4, 5]}}))
    with pytest.raises(PipelineError, match=rf"^output folder {tmp_path}: cannot read extract_shard_1_of_4\.json"):
        check_output_folder(tmp_path, data_config())
    manifest_path(tmp_path, 1, 4).write_text("{torn")
    with pytest.raises(PipelineError, match=r"extract_shard_1_of_4\.json: not valid JSON"):
        check_output_folder(tmp_path, data_config())


def test_data_files_without_a_config_are_not_this_steps(tmp_path):
    check_output_folder(tmp_path, data_config())  # an empty folder is fine
    write_files(tmp_path, {0: 3})
    with pytest.raises(PipelineError, match=f"output folder {tmp_path} holds data files but no {DATA_CONFIG}"):
        check_output_folder(tmp_path, data_config())


def test_rows_past_the_end_of_a_new_prepared_dataset_are_removed(tmp_path):
    write_files(tmp_path, {i: 2 for i in range(6)})
    (tmp_path / SAMPLE_LENGTHS).write_text(json.dumps({str(i): 2 for i in range(6)}))
    data_config().save(tmp_path)
    assert remove_stale_rows(tmp_path, data_config(), 3) == 0  # the same prepared rows: nothing goes
    assert sorted(list_sample_files(tmp_path)) == list(range(6))
    assert remove_stale_rows(tmp_path, data_config(prepared_fingerprint="second"), 3) == 3
    assert sorted(list_sample_files(tmp_path)) == [0, 1, 2] and not sample_path(tmp_path, 3).exists()
    assert not (tmp_path / SAMPLE_LENGTHS).exists()  # the next merge starts from this run's manifests
    assert remove_stale_rows(tmp_path / "new", data_config(prepared_fingerprint="second"), 0) == 0
