"""common/train/trainer.py: the draft's starting point (initialisation, frozen lm_head), what
the Trainer feeds the TTT steps in training and in validation, and the precision it computes in."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import packed_batch

from common.train.optimizers import build_optimizer
from common.train.settings import TrainSettings
from common.train.trainer import autocast, prepare_draft, trainer_config


def own_linears(model) -> list[torch.nn.Linear]:
    return [m for m in [*model.layers.modules(), model.fc] if isinstance(m, torch.nn.Linear)]


def test_normal_init_draws_the_draft_layers_from_n_0_002(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    torch.manual_seed(1)
    prepare_draft(model, TrainSettings(init="normal"))
    weights = torch.cat([m.weight.flatten() for m in own_linears(model)])
    assert weights.std().item() == pytest.approx(0.02, rel=0.02) and abs(weights.mean().item()) < 1e-3
    assert torch.equal(model.lm_head.weight, tiny_draft.lm_head.weight)  # the target's, untouched
    assert torch.equal(model.embed_tokens.weight, tiny_draft.embed_tokens.weight)
    assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in (model.norm, model.layers[0].input_layernorm))
    again = copy.deepcopy(tiny_draft)
    torch.manual_seed(1)
    prepare_draft(again, TrainSettings(init="normal"))
    assert torch.equal(again.fc.weight, model.fc.weight)  # drawn from the seeded generator


def test_torch_init_keeps_the_built_weights(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    prepare_draft(model, TrainSettings(init="torch"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny_draft.state_dict().values()))
    bound = 1 / (3 * 64) ** 0.5  # nn.Linear's kaiming-uniform bound for fc's 192 inputs
    assert model.fc.weight.abs().max().item() <= bound


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_frozen_draft_lm_head_stays_the_targets(tiny_draft, optimizer):
    model = copy.deepcopy(tiny_draft)
    settings = TrainSettings(freeze_draft_lm_head=True, optimizer=optimizer, lr=1e-2)
    prepare_draft(model, settings)
    opt = build_optimizer(model, settings)
    _tokens, loss, _metrics = model(**packed_batch(0), ttt_steps=2)
    loss.backward()
    opt.step()
    assert torch.equal(model.lm_head.weight, tiny_draft.verifier_lm_head.weight)
    assert not torch.equal(model.fc.weight, tiny_draft.fc.weight)


def test_ttt_inputs_reach_the_training_forward_only():
    config = trainer_config(TrainSettings(), Path("ckpt"), False, False, torch.device("cpu"))
    assert config.train_call_kwargs["use_off_policy_tokens"] is True  # the default: teacher-forced
    assert "use_off_policy_tokens" not in config.val_call_kwargs  # validation feeds the draft's guesses, as serving
    old = trainer_config(TrainSettings(ttt_inputs="draft"), Path("ckpt"), False, False, torch.device("cpu"))
    assert old.train_call_kwargs["use_off_policy_tokens"] is False


def test_teacher_forcing_changes_what_step_1_sees(tiny_draft):
    """Step 0 reads the same tokens either way; from step 1 on, the dataset's tokens differ
    from an untrained draft's guesses, so the loss does too."""
    settings = TrainSettings()
    metrics = {}
    for inputs in ("dataset", "draft"):
        kwargs = TrainSettings(ttt_inputs=inputs).train_call_kwargs()
        with torch.no_grad():
            _tokens, _loss, metrics[inputs] = tiny_draft(**packed_batch(3), **kwargs)
    assert metrics["dataset"]["loss_0"] == metrics["draft"]["loss_0"]
    assert metrics["dataset"]["loss_1"] != metrics["draft"]["loss_1"]
    assert settings.call_kwargs() == {"ttt_steps": 3, "ttt_step_loss_decay": 1.0}


@pytest.mark.parametrize(("precision", "device", "expected"), [
    ("auto", "cpu", None), ("auto", "cuda", torch.bfloat16), ("bf16", "cpu", torch.bfloat16),
    ("fp32", "cuda", None)])
def test_precision_picks_bf16_autocast_on_gpus(precision, device, expected):
    assert TrainSettings(precision=precision).autocast_dtype(torch.device(device)) == expected


def test_bf16_autocast_keeps_fp32_weights_and_gradients(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    seen = []
    model.fc.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    autocast(model, "cpu", torch.bfloat16)
    _tokens, loss, _metrics = model(**packed_batch(0), ttt_steps=2)
    loss.backward()
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32  # matmuls in bf16, the loss in fp32
    assert model.fc.weight.dtype == model.fc.weight.grad.dtype == torch.float32
    plain = copy.deepcopy(tiny_draft)
    autocast(plain, "cpu", None)  # fp32: the forward untouched
    assert "forward" not in vars(plain)
