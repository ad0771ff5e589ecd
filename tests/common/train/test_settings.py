"""common/train/settings.py: config files, presets and flags resolved into `TrainSettings`, and
04's flags derived from its fields."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import fields, replace

import pytest

from common.defaults import REAL_TARGETS, REPO_ROOT
from common.draft.model import KIMI_CONFIG, TINY_CONFIG, default_config, read_config_file, speculator_config
from common.errors import PipelineError
from common.target.config import load_target_info
from common.train.settings import TrainSettings, flag_specs


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").glob("draft_*.json")), ids=lambda p: p.name)
def test_every_config_file_loads(path, kimi_target):
    config_file = read_config_file(path)
    settings, overrides = TrainSettings.resolve(config_file, {"lr": 0.5, "epochs": None})
    assert settings.lr == 0.5 and len(overrides) == 1 and "--lr 0.5 overrides" in overrides[0]
    info = load_target_info(kimi_target, trust_remote_code=True)
    info = replace(info, hidden_size=config_file.model.hidden_size)  # the shape of the target it is for
    config = speculator_config(config_file.model, info, config_file.model.draft_vocab_size or 32000, [2, 30, 58], 3)
    layer = config.transformer_layer_config
    assert layer.rope_theta == 50000.0 and layer.rope_scaling["rope_type"] == "yarn"  # copied from the target
    assert layer.num_hidden_layers == 1


def test_kimi_config_has_the_published_shape():
    shape = read_config_file(KIMI_CONFIG).model
    assert (shape.hidden_size, shape.num_attention_heads, shape.head_dim) == (7168, 64, 128)
    assert shape.intermediate_size == 18432 and shape.draft_vocab_size == 32000 and shape.num_hidden_layers == 1


def test_04_picks_the_config_of_the_target_it_is_given(tmp_path):
    """No --draft-config: the tiny draft for the built-in miniature, each built-in real target's own
    (a config file for every name of REAL_TARGETS), Kimi-K2.5's for a folder."""
    assert default_config(None) == TINY_CONFIG
    for name in REAL_TARGETS:
        assert default_config(name) == REPO_ROOT / "configs" / f"draft_{name}.json" and default_config(name).is_file()
    assert default_config(tmp_path / "Kimi-K2.5") == KIMI_CONFIG


@pytest.mark.parametrize("training, message", [
    ({"epochs": "3"}, "epochs = '3' is not of type"),
    ({"learning_rate": 0.1}, "unknown key(s) ['learning_rate']"),
    ({"val_ratio": 1.0}, "--val-ratio 1.0: must be in [0, 1)"),
    ({"scheduler": "step"}, "--scheduler step: must be one of linear, cosine, none"),
    ({"optimizer": "sgd"}, "--optimizer sgd: must be one of muon, adamw"),
    ({"ttt_inputs": "target"}, "--ttt-inputs target: must be one of dataset, draft"),
    ({"init": "xavier"}, "--init xavier: must be one of normal, torch"),
    ({"muon_lr": 0}, "--muon-lr 0: must be positive"),
    ({"loss": "ce"}, "--loss ce: must be one of kl, tv, lk, lk-hybrid, jsd, rkl"),
    ({"select_k": 0}, "--select-k 0: must be at least 1"),
    ({"target_temperature": 0.0}, "--target-temperature 0.0: must be positive"),
    ({"freeze_draft_lm_head": 1}, "freeze_draft_lm_head = 1 is not of type <class 'bool'>"),
])
def test_bad_training_values_are_refused(tmp_path, training, message):
    data = json.loads(TINY_CONFIG.read_text())
    data["training"].update(training)
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(PipelineError) as error:
        TrainSettings.resolve(read_config_file(tmp_path / "c.json"), {})
    assert message in str(error.value)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "presets").glob("*.json")), ids=lambda p: p.name)
def test_every_preset_loads_and_sits_between_config_and_flags(path):
    preset = json.loads(path.read_text())["training"]
    settings, overrides = TrainSettings.resolve(read_config_file(KIMI_CONFIG), {"epochs": 7}, path)
    for name, value in preset.items():
        assert getattr(settings, name) == (7 if name == "epochs" else value)
    assert any(line.startswith(f"preset {path}: ") for line in overrides)
    assert overrides[-1].startswith("--epochs 7 overrides")


def test_presets_cover_the_three_run_sizes():
    names = {p.stem for p in (REPO_ROOT / "configs" / "presets").glob("*.json")}
    assert names == {"smoke_10", "local_1000", "full_500k"}


def test_bad_preset_is_refused(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"training": {"epoch": 2}}))
    with pytest.raises(PipelineError, match=r"preset .*p.json \[training\]: unknown key"):
        TrainSettings.resolve(read_config_file(TINY_CONFIG), {}, tmp_path / "p.json")


def parse_04(*argv: str):
    spec = importlib.util.spec_from_file_location("train_04", REPO_ROOT / "04_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(list(argv))


def test_04_has_one_flag_per_setting_and_leaves_unset_ones_to_the_file():
    names = [f.name for f in fields(TrainSettings)]
    assert list(flag_specs()) == names
    unset = parse_04()
    assert all(getattr(unset, name) is None for name in names)
    args = parse_04("--optimizer", "adamw", "--muon-lr", "0.02", "--freeze-draft-lm-head", "--warmup-steps", "5",
                    "--ttt-inputs", "draft", "--init", "torch")
    assert (args.optimizer, args.muon_lr, args.freeze_draft_lm_head, args.warmup_steps) == ("adamw", 0.02, True, 5)
    assert parse_04("--no-freeze-draft-lm-head").freeze_draft_lm_head is False
    settings, overrides = TrainSettings.resolve(read_config_file(TINY_CONFIG), {n: getattr(args, n) for n in names})
    assert (settings.optimizer, settings.ttt_inputs, settings.init) == ("adamw", "draft", "torch")
    assert "--freeze-draft-lm-head True overrides False" in overrides


def test_training_forward_is_teacher_forced_unless_asked():
    assert TrainSettings().train_call_kwargs()["use_off_policy_tokens"] is True
    assert TrainSettings(ttt_inputs="draft").train_call_kwargs()["use_off_policy_tokens"] is False
    assert "use_off_policy_tokens" not in TrainSettings().call_kwargs()


def test_more_ttt_steps_than_the_served_k_train_and_validate_them_all():
    """Training and validation run every TTT step trained; validation at least the served k's
    (its simulated acceptance length at k needs k steps); the served k defaults to --ttt-steps."""
    deeper = TrainSettings(ttt_steps=7, ttt_step_loss_decay=0.8, select_k=3)
    assert deeper.served_k == 3
    assert deeper.train_call_kwargs()["ttt_steps"] == deeper.call_kwargs()["ttt_steps"] == 7
    shallower = TrainSettings(ttt_steps=3, select_k=5)
    assert (shallower.train_call_kwargs()["ttt_steps"], shallower.call_kwargs()["ttt_steps"]) == (3, 5)
    assert TrainSettings(ttt_steps=4).served_k == 4


def test_kimi_config_trains_the_500k_runs_epochs():
    """A Kimi-K2.5 run without a preset trains what the 500K preset does: more epochs hurt there."""
    full = json.loads((REPO_ROOT / "configs" / "presets" / "full_500k.json").read_text())["training"]
    assert read_config_file(KIMI_CONFIG).training["epochs"] == full["epochs"] == 3
