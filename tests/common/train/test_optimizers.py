"""common/train/optimizers.py: which parameters Muon and AdamW get, the combined optimizer's
exact resume, and the library's schedule on both groups."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import packed_batch

from common.train.optimizers import MuonWithAdamW, build_optimizer, build_scheduler, muon_parameters
from common.train.settings import TrainSettings
from common.train.trainer import prepare_draft


def train_steps(model, opt, scheduler, seeds: range) -> None:
    """The library's step: forward, backward, clip, optimizer, scheduler."""
    for seed in seeds:
        _tokens, loss, _metrics = model(**packed_batch(seed), ttt_steps=2, use_off_policy_tokens=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()


def group_names(opt: torch.optim.Optimizer) -> list[set[str]]:
    return [set(g["param_names"]) for g in opt.param_groups]


def test_muon_takes_the_draft_layers_matrices_and_adamw_the_rest(tiny_draft):
    opt = build_optimizer(tiny_draft, TrainSettings(optimizer="muon"))
    muon, adamw = group_names(opt)
    assert muon == {"fc.weight", *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert {"lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"} <= adamw
    assert all(tiny_draft.get_parameter(n).ndim == 1 for n in adamw - {"lm_head.weight"})
    assert not {"embed_tokens.weight", "verifier_lm_head.weight"} & (muon | adamw)  # the target's, frozen
    assert [type(o) for o in (opt.muon, opt.adamw)] == [torch.optim.Muon, torch.optim.AdamW]


def test_muon_weight_decay_is_its_own_setting(tiny_draft):
    """`--muon-weight-decay` sets the Muon matrices' decay (by default upstream's 0.1); AdamW's stays 0.01."""
    muon, adamw = build_optimizer(tiny_draft, TrainSettings(muon_weight_decay=0.03)).param_groups
    assert (muon["weight_decay"], adamw["weight_decay"]) == (0.03, 0.01)
    muon, adamw = build_optimizer(tiny_draft, TrainSettings()).param_groups
    assert (muon["weight_decay"], adamw["weight_decay"]) == (0.1, 0.01)


def test_frozen_lm_head_is_in_no_group(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    prepare_draft(model, TrainSettings(freeze_draft_lm_head=True, init="torch"))
    assert not any("lm_head.weight" in names for names in group_names(build_optimizer(model, TrainSettings())))
    assert "lm_head.weight" not in {n for n, _ in muon_parameters(model)}


def test_adamw_is_the_librarys_optimizer(tiny_draft):
    opt = build_optimizer(tiny_draft, TrainSettings(optimizer="adamw", lr=3e-3))
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    assert opt.param_groups[0]["param_names"] == [n for n, _ in tiny_draft.named_parameters()]
    assert opt.param_groups[0]["lr"] == 3e-3


def test_schedule_warms_up_and_decays_both_groups(tiny_draft):
    settings = TrainSettings(lr=1e-3, muon_lr=2e-2, epochs=2, warmup_steps=5)
    opt = build_optimizer(copy.deepcopy(tiny_draft), settings)
    scheduler = build_scheduler(opt, settings, steps_per_epoch=10)
    lrs = []
    for _ in range(20):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        scheduler.step()
    assert lrs[0] == [0.0, 0.0]
    assert lrs[5] == pytest.approx([2e-2, 1e-3])  # peak after the warm-up, Muon's own rate
    assert lrs[19] == pytest.approx([2e-2 / 15, 1e-3 / 15])  # linear to 0 at step 20
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [g["lr"] for g in opt.param_groups]
    assert build_scheduler(opt, TrainSettings(scheduler="none"), 10) is None


def test_muon_with_adamw_resumes_exactly(tiny_draft):
    """State saved after 2 steps and loaded into a fresh draft and optimizer: steps 3-4 give
    bitwise the weights of the uninterrupted run (momentum, AdamW moments and step, schedule)."""
    settings = TrainSettings(lr=5e-3, epochs=1, warmup_steps=1)
    whole = copy.deepcopy(tiny_draft)
    opt = build_optimizer(whole, settings)
    scheduler = build_scheduler(opt, settings, 4)
    train_steps(whole, opt, scheduler, range(2))
    saved = copy.deepcopy((whole.state_dict(), opt.state_dict(), scheduler.state_dict()))
    states = saved[1]["state"]
    assert set(states[0]) == {"momentum_buffer"} and "exp_avg_sq" in states[max(states)]  # Muon's, then AdamW's
    train_steps(whole, opt, scheduler, range(2, 4))

    resumed = copy.deepcopy(tiny_draft)
    resumed.load_state_dict(saved[0])
    opt2 = build_optimizer(resumed, settings)
    scheduler2 = build_scheduler(opt2, settings, 4)
    opt2.load_state_dict(saved[1])
    scheduler2.load_state_dict(saved[2])
    assert isinstance(opt2, MuonWithAdamW) and opt2.muon.state is opt2.state is opt2.adamw.state
    train_steps(resumed, opt2, scheduler2, range(2, 4))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(whole.fc.weight, tiny_draft.fc.weight)  # it did train
