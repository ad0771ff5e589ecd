"""common/draft/loss.py: the draft's loss over the verifier's softmax computed once per batch, against
the unpatched speculators 0.3.0 (bitwise gradients), the other divergences against their definitions,
and the choice `patch.apply(loss=..., target_temperature=...)` installs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import draft_inputs, installed_loss, make_draft
from speculators.models.eagle3 import core as eagle3_core
from torch.distributions import Categorical, kl_divergence

from common.draft import loss as loss_module
from common.draft import patch
from common.draft.loss import LOSSES, DraftLoss


@pytest.fixture(autouse=True)
def patched():
    patch.apply(trust_remote_code=True, compile_forward=False)


def train_steps(target, compute_metrics, monkeypatch, off_policy: bool) -> tuple[dict, list[dict]]:
    """Three AdamW steps of a fresh draft on one batch (a loss mask with holes, padding, TTT loss
    decay) with `compute_metrics` as the draft's loss; its weights and each step's metrics."""
    monkeypatch.setattr(eagle3_core, "compute_metrics", compute_metrics)
    model = make_draft(target)
    inputs = draft_inputs(vocab=model.embed_tokens.num_embeddings)
    inputs["loss_mask"][:, ::3] = 0
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    metrics = []
    for _ in range(3):
        _tokens, loss, step_metrics = model(**inputs, ttt_step_loss_decay=0.8, use_off_policy_tokens=off_policy)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        metrics.append(step_metrics)
    return model.state_dict(), metrics


@pytest.mark.parametrize("off_policy", [True, False], ids=["teacher-forced", "draft-fed"])
def test_loss_once_per_batch_trains_the_library_s_draft_bitwise(flat_target, monkeypatch, off_policy):
    ours, our_metrics = train_steps(flat_target, DraftLoss().compute_metrics, monkeypatch, off_policy)
    theirs, their_metrics = train_steps(flat_target, patch.ORIGINAL_COMPUTE_METRICS, monkeypatch, off_policy)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for step_ours, step_theirs in zip(our_metrics, their_metrics):
        assert step_ours.keys() == step_theirs.keys()
        for name, value in step_theirs.items():
            if name.startswith("loss"):  # the same KL, summed in another order
                assert step_ours[name].item() == pytest.approx(value.item(), rel=1e-5), name
            else:
                assert torch.equal(step_ours[name], value), name


def test_loss_once_per_batch_equals_the_library_s_on_extreme_logits():
    """Targets whose softmax underflows to 0 in places (p log p must read 0 there, not nan), no
    loss mask, and `prev_correct` updated in place as the library updates it."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 40, 50, generator=g, requires_grad=True)
    targets = torch.randn(1, 40, 50, generator=g) * 60  # gaps of hundreds: exp underflows
    draft_loss = DraftLoss()
    for ttt_step in range(3):
        ours_prev, theirs_prev = torch.ones(1, 40, dtype=torch.bool), torch.ones(1, 40, dtype=torch.bool)
        ours_prev[:, ::5] = theirs_prev[:, ::5] = False
        ours = draft_loss.compute_metrics(logits, targets, None, ours_prev, ttt_step, 0.8)
        theirs = patch.ORIGINAL_COMPUTE_METRICS(logits, targets, None, theirs_prev, ttt_step, 0.8)
        assert torch.isfinite(ours[0]) and ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-5)
        assert torch.equal(ours_prev, theirs_prev)
        for name in (f"full_acc_{ttt_step}", f"cond_acc_{ttt_step}"):
            assert torch.equal(ours[1][name], theirs[1][name])
        our_grad, = torch.autograd.grad(ours[0], logits)
        their_grad, = torch.autograd.grad(theirs[0], logits)
        assert torch.equal(our_grad, their_grad)


@pytest.mark.parametrize("pad_rows", [loss_module.PAD_ROWS, 1], ids=["padded", "later-steps-sliced"])
def test_kl_of_unsliced_logits_is_the_sliced_kl_bitwise(pad_rows, monkeypatch):
    """TTT steps after the first read the draft's logits whole against targets padded with rows of
    zeros (`kl_loss_aligned`): the loss and every row's gradient are the bits of the KL of the sliced
    logits (`kl_loss`, the library's alignment), the rows without a target get zeros. Steps past
    the padding (`pad_rows` 1: step 2) slice as before."""
    monkeypatch.setattr(loss_module, "PAD_ROWS", pad_rows)
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 50, 70, generator=g).mul(3).requires_grad_()
    targets = torch.randn(1, 50, 70, generator=g) * 4
    mask = (torch.rand(1, 50, generator=g) > 0.3).long()
    draft_loss = DraftLoss("kl", 0.5)
    assert draft_loss.targets_of(targets).p_rows.shape == (1, 50 + pad_rows, 70)
    for step in range(3):
        ours, _ = draft_loss.compute_metrics(logits, targets, mask, mask.bool().clone(), step, 0.8)
        t = loss_module.verifier_targets(targets, "kl", 0.5)  # unpadded
        sliced = 0.8**step * loss_module.kl_loss(logits[:, :50 - step], t.p[:, step:], t.p_log_p[:, step:],
                                                  mask[:, step:])
        assert torch.equal(ours, sliced), step
        our_grad, = torch.autograd.grad(ours, logits)
        sliced_grad, = torch.autograd.grad(sliced, logits)
        assert torch.equal(our_grad, sliced_grad), step
        assert not our_grad[:, 50 - step:].any()


def test_kl_under_autocast_keeps_its_unpadded_targets():
    """Under autocast the softmax is made in autocast's dtype: no padded buffer in the logits' dtype."""
    targets = torch.randn(1, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert DraftLoss("kl").targets_of(targets).p_rows is None
    assert DraftLoss("kl").targets_of(targets).p_rows is not None
    assert DraftLoss("tv").targets_of(targets).p_rows is None  # the other losses slice as before


def reference_divergence(name: str, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per token, from the definitions written another way: TV as half the L1 distance, KL and
    reverse KL by torch.distributions, JSD as H(m) - (H(p) + H(q)) / 2."""
    p, q = Categorical(logits=targets), Categorical(logits=logits)
    tv = 0.5 * (p.probs - q.probs).abs().sum(-1)
    if name == "kl":
        return kl_divergence(p, q)
    if name == "rkl":
        return kl_divergence(q, p)
    if name == "tv":
        return tv
    if name == "lk":
        return -torch.log(1 - tv)
    if name == "lk-hybrid":
        weight = torch.exp(-3.0 * (1 - tv)).detach()
        return weight * kl_divergence(p, q) + (1 - weight) * tv
    m = Categorical(probs=(p.probs + q.probs) / 2)
    return m.entropy() - (p.entropy() + q.entropy()) / 2


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_is_its_definition_masked_decayed_and_differentiated(loss, temperature):
    """Value and gradient of every TTT step's loss: the masked mean over tokens of the divergence
    to the target's distribution at `temperature` (softmax(logits / T)), times decay**step, with
    the targets shifted as the library aligns them. The accuracies compare the draft's argmax
    with the target's, which no temperature changes."""
    patch.apply(trust_remote_code=True, compile_forward=False, loss=loss, target_temperature=temperature)
    compute_metrics = installed_loss().compute_metrics
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 30, 40, generator=g).mul(2).requires_grad_()
    targets = torch.randn(1, 30, 40, generator=g) * 3
    mask = (torch.rand(1, 30, generator=g) > 0.3).long()
    for step in range(3):
        ours, metrics = compute_metrics(logits, targets, mask, torch.ones(1, 30, dtype=torch.bool), step, 0.8)
        s_logits = logits[:, :30 - step]
        per_token = reference_divergence(loss, s_logits, targets[:, step:] / temperature)
        s_mask = mask[:, step:]
        reference = 0.8**step * (per_token * s_mask).sum() / (s_mask.sum() + 1e-5)
        assert ours.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)
        assert metrics[f"loss_{step}"].item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)
        our_grad, = torch.autograd.grad(ours, logits)
        their_grad, = torch.autograd.grad(reference, logits)
        assert torch.allclose(our_grad, their_grad, rtol=1e-4, atol=1e-7), loss
        agree = (s_logits.argmax(-1) == targets[:, step:].argmax(-1))[s_mask.bool()].float().mean()
        assert metrics[f"full_acc_{step}"].item() == pytest.approx(agree.item(), abs=1e-5)


def test_a_sharper_target_moves_the_draft_toward_the_target_s_argmax():
    """At a temperature below 1 the KL target weighs the target's argmax more: the gradient step
    raises the draft's probability of that token further than at temperature 1."""
    targets = torch.log(torch.tensor([[[0.4, 0.35, 0.25]]]))
    gains = {}
    for temperature in (1.0, 0.5):
        patch.apply(compile_forward=False, target_temperature=temperature)
        logits = torch.zeros(1, 1, 3, requires_grad=True)
        loss, _ = installed_loss().compute_metrics(logits, targets, None, None, 0, 1.0)
        grad, = torch.autograd.grad(loss, logits)
        gains[temperature] = torch.softmax(logits - grad, -1)[0, 0, 0].item()
    patch.apply(compile_forward=False)
    assert gains[0.5] > gains[1.0] > 1 / 3


def test_losses_aimed_at_acceptance_order_drafts_by_acceptance():
    """TV is 1 - the acceptance probability sum_v min(p_v, q_v), LK its -log: a draft closer to
    the target in acceptance scores lower on both, and a perfect draft scores 0."""
    targets = torch.log(torch.tensor([[[0.6, 0.3, 0.1]]]))
    close, far = torch.log(torch.tensor([[[0.5, 0.4, 0.1]]])), torch.log(torch.tensor([[[0.1, 0.3, 0.6]]]))
    for loss, expected_far in (("tv", 0.5), ("lk", -math.log(0.5))):
        patch.apply(trust_remote_code=True, compile_forward=False, loss=loss)
        compute_metrics = installed_loss().compute_metrics
        value = {name: compute_metrics(draft, targets, None, None, 0, 1.0)[0].item()
                 for name, draft in (("same", targets), ("close", close), ("far", far))}
        assert value["same"] == pytest.approx(0.0, abs=1e-6)
        assert value["close"] == pytest.approx(0.1 if loss == "tv" else -math.log(0.9), rel=1e-5)
        assert value["far"] == pytest.approx(expected_far, rel=1e-5)


def test_an_unknown_loss_is_refused_and_compiled_kl_keeps_the_library_s():
    with pytest.raises(ValueError, match="loss 'ce': expected one of kl, tv, lk, lk-hybrid, jsd, rkl"):
        patch.apply(loss="ce")
    patch.apply(compile_forward=True, loss="tv")  # compiled with another loss: ours, which the compiler can trace
    assert (installed_loss().name, installed_loss().target_temperature) == ("tv", 1.0)
    patch.apply(compile_forward=True, target_temperature=0.5)  # the library's knows no temperature: ours
    assert (installed_loss().name, installed_loss().target_temperature) == ("kl", 0.5)
    with pytest.raises(ValueError, match="target_temperature 0: must be positive"):
        patch.apply(target_temperature=0)
    patch.apply(compile_forward=True)
    assert eagle3_core.compute_metrics is patch.ORIGINAL_COMPUTE_METRICS


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_compiles_in_one_graph(loss):
    """On GPUs the forward is compiled: every loss traces without a graph break (the per-batch cache
    is skipped under the compiler) and gives the eager value and gradient. aot_eager: dynamo and
    autograd's tracing without inductor's code generation, which a CPU test need not pay for."""
    patch.apply(compile_forward=True, loss=loss, target_temperature=0.7)
    compute_metrics = installed_loss().compute_metrics
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 20, 30, generator=g, requires_grad=True)
    targets, mask = torch.randn(1, 20, 30, generator=g), torch.ones(1, 20, dtype=torch.long)
    compiled = torch.compile(compute_metrics, backend="aot_eager", fullgraph=True)
    ours, _ = compiled(logits, targets, mask, torch.ones(1, 20, dtype=torch.bool), 1, 0.8)
    our_grad, = torch.autograd.grad(ours, logits)
    eager, _ = compute_metrics(logits, targets, mask, torch.ones(1, 20, dtype=torch.bool), 1, 0.8)
    eager_grad, = torch.autograd.grad(eager, logits)
    assert ours.item() == pytest.approx(eager.item(), rel=1e-6)
    assert torch.allclose(our_grad, eager_grad, rtol=1e-5, atol=1e-8)
