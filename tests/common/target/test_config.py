"""common/target/config.py: a target's facts read once from its config files (nested or flat, the
generation defaults, the text architecture), errors that name the folder, and the auxiliary layer ids
(EAGLE-3's defaults or the user's, checked against the target's depth)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig

from common.errors import PipelineError
from common.target.config import TargetError, choose_layer_ids, load_target_info, validate_layer_ids
from common.target.model import load_text_model


def test_target_errors_name_the_folder(tmp_path, kimi_target):
    with pytest.raises(TargetError, match=str(tmp_path / "nope")):
        load_target_info(tmp_path / "nope", trust_remote_code=True)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((kimi_target / "config.json").read_text())
    for name in ("configuration_kimi_k25.py",):
        (no_weights / name).write_text((kimi_target / name).read_text())
    info = load_target_info(no_weights, trust_remote_code=True)
    with pytest.raises(TargetError, match="no weights"):
        load_text_model(info)
    not_lm = tmp_path / "not_lm"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 8}))
    with pytest.raises(TargetError, match="not a causal language model"):
        load_target_info(not_lm, trust_remote_code=True)
    with pytest.raises(TargetError, match="trust-remote-code"):
        load_target_info(kimi_target, trust_remote_code=False)


def _flat_copy(flat_target, tmp_path, generation: dict | None):
    folder = tmp_path / "target"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((flat_target / "config.json").read_text())
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_generation_defaults_come_from_generation_config(flat_target, tmp_path):
    sampled = load_target_info(_flat_copy(flat_target, tmp_path / "a", {"eos_token_id": [7, 9], "temperature": 0.6,
                                                                        "top_p": 0.95}))
    assert (sampled.temperature, sampled.top_p) == (0.6, 0.95)
    assert {7, 9} <= sampled.stop_ids
    greedy = load_target_info(_flat_copy(flat_target, tmp_path / "b", {"do_sample": False, "temperature": 0.6}))
    assert (greedy.temperature, greedy.top_p) == (0.0, 1.0)
    bare = load_target_info(_flat_copy(flat_target, tmp_path / "c", None))
    assert (bare.temperature, bare.top_p) == (0.0, 1.0)
    assert bare.stop_ids == frozenset(_ids(AutoConfig.from_pretrained(flat_target).eos_token_id))


def _ids(value) -> set[int]:
    return {value} if isinstance(value, int) else set(value or ())


def test_kimi_stop_ids_include_im_end_from_its_generation_config(kimi_target):
    info = load_target_info(kimi_target, trust_remote_code=True)
    assert {163585, 163586} <= info.stop_ids  # [EOS] of text_config, <|im_end|> of generation_config.json


def test_a_broken_generation_config_names_the_file(flat_target, tmp_path):
    folder = _flat_copy(flat_target, tmp_path, None)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(TargetError, match=f"target {folder}: cannot read generation_config.json"):
        load_target_info(folder)


def test_remote_code_is_not_trusted_by_default(kimi_target):
    with pytest.raises(TargetError, match="its config is remote code; pass --trust-remote-code"):
        load_target_info(kimi_target)


def test_a_nested_text_config_without_architectures(kimi_target, tmp_path):
    """Kimi-K2.5's text_config (kimi_k2) names no architectures: it is read as DeepSeek-V3; an unknown
    model_type there is refused, naming it."""
    folder = tmp_path / "target"
    folder.mkdir()
    for name in ("configuration_kimi_k25.py", "config.json"):
        (folder / name).write_text((kimi_target / name).read_text())
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_target_info(folder, trust_remote_code=True).text_architecture == "DeepseekV3ForCausalLM"


def test_layer_ids_range():
    assert validate_layer_ids([1, 4, 7], 8) == [1, 4, 7]
    for bad in ([0, 2, 3], [2, 4, 8], [2, 2, 3], [2, 3]):
        with pytest.raises(PipelineError, match=r"1\.\.7 for a target with 8 layers"):
            validate_layer_ids(bad, 8)


def test_a_target_too_shallow_for_the_default_layers_is_told_so(flat_target):
    """EAGLE-3's defaults [2, N//2, N-3] coincide below 7 layers: the error names the target and
    the defaults instead of quoting ids the user never typed; given ids are checked as they are."""
    info = dataclasses.replace(load_target_info(flat_target), num_layers=6)
    with pytest.raises(PipelineError, match=r"target .*: EAGLE-3's default auxiliary layers \[2, N//2, N-3\] are "
                                            r"\[2, 3, 3\] for its 6 layers, not three distinct ids in 1\.\.5; pass "
                                            r"--layer-ids with three"):
        choose_layer_ids(None, info)
    assert choose_layer_ids([1, 2, 4], info) == [1, 2, 4]
    assert choose_layer_ids(None, load_target_info(flat_target)) == [2, 4, 5]
