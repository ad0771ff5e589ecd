"""common/draft/forward.py: the draft's forward with each TTT step checkpointed and the loss taken by
token tiles, against speculators 0.3.0's forward (with the project's `DraftLoss`, as patch.apply
installs it) and against itself without checkpointing; its peak memory; what patch.apply installs
for it; and the compiled FlexAttention the layers get on GPUs.

Every comparison runs on a CPU in fp32, where each kernel gives the same bits for the same inputs.
Bitwise: checkpointing on vs off (the recomputation repeats the same operations, the autograd graph
is the same), and ours vs the library's while a step is one tile (the same products in the same
order; the CPU's matmul computes a row alike whatever rows it is batched with). Within float rounding: ours vs the library's with
several tiles per step (a step's loss is then a sum of tile sums, lm_head's weight gradient a sum of
tile products); the accuracies and draft tokens compare argmaxes of the same logits, so stay exact."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from helpers import DRAFT_SHAPE, draft_inputs, make_draft
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3 import core as eagle3_core
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.attention.flex_attention import flex_attention

from common.draft import eagle31, patch
from common.draft import forward as draft_forward
from common.draft.loss import LOSSES, DraftLoss
from common.draft.model import identity_maps, speculator_config
from common.target.config import load_target_info

EAGLE31 = dataclasses.replace(DRAFT_SHAPE, norm_before_fc=True, norm_output=True)
LIBRARY = patch.eager(patch.ORIGINAL_FORWARD)


@pytest.fixture(autouse=True)
def patched(one_thread):
    patch.apply(trust_remote_code=True, compile_forward=False)
    yield
    patch.apply(trust_remote_code=True, compile_forward=False)


class Result(NamedTuple):
    tokens: list[torch.Tensor]
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


def run(model: Eagle3DraftModel, forward, inputs: dict, **kwargs) -> Result:
    """One training step's forward and backward through `forward` installed as the draft's."""
    model.zero_grad(set_to_none=True)
    tokens, loss, metrics = forward(model, **inputs, **kwargs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return Result(tokens, loss.detach(), metrics, grads)


def library_step(model: Eagle3DraftModel, inputs: dict, loss: str = "kl", temperature: float = 1.0,
                 **kwargs) -> Result:
    """The library's eager forward with `DraftLoss(loss, temperature)` as its compute_metrics."""
    patch.apply(trust_remote_code=True, compile_forward=False, loss=loss, target_temperature=temperature)
    return run(model, LIBRARY, inputs, **kwargs)


def our_step(model: Eagle3DraftModel, inputs: dict, checkpointing: bool, loss: str = "kl",
             temperature: float = 1.0, **kwargs) -> Result:
    return run(model, draft_forward.make_forward(DraftLoss(loss, temperature), checkpointing), inputs, **kwargs)


def assert_same(ours: Result, theirs: Result) -> None:
    assert len(ours.tokens) == len(theirs.tokens)
    for a, b in zip(ours.tokens, theirs.tokens):
        assert torch.equal(a, b)
    assert torch.equal(ours.loss, theirs.loss)
    assert list(ours.metrics) == list(theirs.metrics)  # the library's keys, in its order
    for name, value in theirs.metrics.items():
        assert torch.equal(ours.metrics[name], value), name
    assert ours.grads.keys() == theirs.grads.keys()
    for name, value in theirs.grads.items():
        assert torch.equal(ours.grads[name], value), name


def assert_close(ours: Result, theirs: Result) -> None:
    """Losses and gradients within float rounding; tokens and accuracies exactly."""
    for a, b in zip(ours.tokens, theirs.tokens, strict=True):
        assert torch.equal(a, b)
    assert list(ours.metrics) == list(theirs.metrics)
    for name, value in theirs.metrics.items():
        if name.startswith("loss"):
            assert ours.metrics[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), name
        else:
            assert torch.equal(ours.metrics[name], value), name
    assert ours.loss.item() == pytest.approx(theirs.loss.item(), rel=1e-5)
    assert ours.grads.keys() == theirs.grads.keys()
    for name, value in theirs.grads.items():
        assert torch.allclose(ours.grads[name], value, rtol=1e-5, atol=1e-6 * value.abs().max().item()), name


def holed_inputs(model: Eagle3DraftModel, masked: bool = True) -> dict:
    """draft_inputs (256 tokens: three packed samples, then padding) with a loss mask with holes, or none."""
    inputs = draft_inputs(vocab=model.embed_tokens.num_embeddings)
    if masked:
        inputs["loss_mask"][:, ::3] = 0
    else:
        del inputs["loss_mask"]
    return inputs


def eagle31_draft(target) -> Eagle3DraftModel:
    model = make_draft(target, EAGLE31)
    eagle31.install(model, norm_before_fc=True, norm_output=True)
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if "norm" in name:  # away from 1: a norm applied twice or not at all shows
            p.data = 0.5 + torch.rand(p.shape, generator=g)
    return model


VARIANTS = {"teacher-forced": (True, True, False), "draft-fed": (False, True, False),
            "no-loss-mask": (True, False, False), "eagle-3.1-draft-fed": (False, True, True)}


def variant(target, name: str) -> tuple[Eagle3DraftModel, dict, dict]:
    off_policy, masked, norms = VARIANTS[name]
    model = eagle31_draft(target) if norms else make_draft(target)
    return model, holed_inputs(model, masked), {"use_off_policy_tokens": off_policy, "ttt_step_loss_decay": 0.8}


@pytest.mark.parametrize("name", VARIANTS)
def test_one_tile_per_step_is_the_library_s_forward_bitwise(flat_target, name):
    """256 tokens, one tile per step: loss, metrics, draft tokens and every gradient are the
    library's bits, checkpointed or not (see the module's docstring for why bitwise)."""
    model, inputs, kwargs = variant(flat_target, name)
    theirs = library_step(model, inputs, **kwargs)
    assert_same(our_step(model, inputs, checkpointing=False, **kwargs), theirs)
    assert_same(our_step(model, inputs, checkpointing=True, **kwargs), theirs)


@pytest.mark.parametrize("tile", [64, 127], ids=["tiles-of-64", "tiles-of-127"])
@pytest.mark.parametrize("name", VARIANTS)
def test_checkpointing_changes_no_bit_and_tiles_only_rounding(flat_target, monkeypatch, name, tile):
    """Several tiles per step (127: at steps 2 the last tile holds only positions without a target):
    checkpointed equals unchecked bitwise, and both equal the library's within rounding."""
    monkeypatch.setattr(draft_forward, "TILE_TOKENS", tile)
    model, inputs, kwargs = variant(flat_target, name)
    theirs = library_step(model, inputs, **kwargs)
    unchecked = our_step(model, inputs, checkpointing=False, **kwargs)
    assert_same(our_step(model, inputs, checkpointing=True, **kwargs), unchecked)
    assert_close(unchecked, theirs)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_and_temperature_by_tiles_equals_draft_loss(flat_target, monkeypatch, loss):
    monkeypatch.setattr(draft_forward, "TILE_TOKENS", 64)
    model = make_draft(flat_target)
    inputs = holed_inputs(model)
    theirs = library_step(model, inputs, loss, 0.5, ttt_step_loss_decay=0.8)
    ours = our_step(model, inputs, checkpointing=True, loss=loss, temperature=0.5, ttt_step_loss_decay=0.8)
    assert_close(ours, theirs)


def test_validation_pass_without_gradients(flat_target, monkeypatch):
    """Under no_grad (04's validation) nothing is checkpointed; with targets it gives the library's
    loss and metrics, without them (a proposer's call) its draft tokens."""
    monkeypatch.setattr(draft_forward, "TILE_TOKENS", 64)
    model = make_draft(flat_target)
    inputs = holed_inputs(model) | {"ttt_steps": 4}  # validation runs as many steps as the served k needs
    forward = draft_forward.make_forward(DraftLoss(), checkpointing=True)
    with torch.no_grad():
        ours = forward(model, **inputs)
        theirs = LIBRARY(model, **inputs)
        assert_close(Result(*ours, {}), Result(*theirs, {}))
        inputs.pop("verifier_last_hidden_states")
        for a, b in zip(forward(model, **inputs), LIBRARY(model, **inputs), strict=True):
            assert torch.equal(a, b)


def peak_bytes(model: Eagle3DraftModel, forward, inputs: dict, monkeypatch) -> int:
    """Peak tensor memory of one forward and backward (MemTracker: every storage made under it)."""
    monkeypatch.setattr(Eagle3DraftModel, "forward", forward)  # called as a module: MemTracker follows modules
    model.zero_grad(set_to_none=True)
    with MemTracker() as tracker:
        _tokens, loss, _metrics = model(**inputs)
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")
    return peak[torch.device("cpu")]["Total"]


def test_checkpointed_step_peaks_at_a_fraction_of_the_plain_step(flat_target, monkeypatch):
    """2,048 tokens, the miniature's whole 4,096-id vocabulary as the draft's, 3 TTT steps, where
    [tokens x vocabulary] tensors (32 MiB each) dominate: the checkpointed step's peak is at most
    0.6 of the library's (measured 124 / 363 MiB = 0.34, 48 MiB of it the dense mask of the CPU's
    attention, which GPUs do not make)."""
    info = load_target_info(flat_target, trust_remote_code=True)
    config = speculator_config(DRAFT_SHAPE, info, info.vocab_size, info.default_layer_ids(), speculative_tokens=3)
    maps = identity_maps(info.vocab_size)
    torch.manual_seed(0)
    model = Eagle3DraftModel(config, maps["t2d"], maps["d2t"])
    # MemTracker hooks every parameter of each module it sees run, which torch refuses for frozen ones;
    # the frozen two (embedding, verifier's lm_head) run under no_grad in both forwards, so unfreezing
    # them changes nothing computed.
    for p in model.parameters():
        p.requires_grad_(True)
    inputs = draft_inputs(seq=2048, vocab=info.vocab_size)
    inputs["lengths"] = torch.tensor([1024, 512, 500])
    plain = peak_bytes(model, LIBRARY, inputs, monkeypatch)
    checkpointed = peak_bytes(model, draft_forward.make_forward(DraftLoss(), checkpointing=True), inputs, monkeypatch)
    assert checkpointed <= 0.6 * plain, (checkpointed / 2**20, plain / 2**20)


# --- what patch.apply installs ---

def test_apply_installs_the_checkpointed_forward_with_its_loss():
    patch.apply(compile_forward=True, loss="tv", target_temperature=0.5, activation_checkpointing=True)
    forward = Eagle3DraftModel.forward
    assert forward.checkpointing and repr(forward.draft_loss) == "DraftLoss('tv', target_temperature=0.5)"
    assert eagle3_core.create_block_mask is patch.create_block_mask  # eager: the CPU mask needs no blocks
    patch.apply(compile_forward=True)
    assert Eagle3DraftModel.forward is patch.ORIGINAL_FORWARD
    assert eagle3_core.create_block_mask is patch.ORIGINAL_CREATE_BLOCK_MASK


def test_gpu_attention_calls_flex_attention_compiled_once(monkeypatch):
    """Off the CPU the layers' attention calls FlexAttention compiled on its own (an eager call would
    take its dense fallback), or the plain function inside a forward compiled as a whole. Checked
    here on the meta device, with the compiled function stood in for."""
    compiled = patch.compiled_flex_attention()
    assert compiled is patch.compiled_flex_attention()
    assert getattr(compiled, "_torchdynamo_orig_callable", None) is flex_attention
    calls = []

    def fake_flex(query, key, value, **kwargs):
        calls.append(kwargs)
        return torch.empty_like(query)

    monkeypatch.setattr(patch, "compiled_flex_attention", lambda: fake_flex)
    query, key = torch.empty(1, 4, 8, 16, device="meta"), torch.empty(1, 2, 8, 16, device="meta")
    out, weights = patch.attention_forward(None, query, key, key, "the block mask", scaling=0.25)
    assert out.shape == (1, 8, 4, 16) and weights is None
    assert calls == [{"block_mask": "the block mask", "enable_gqa": True, "scale": 0.25}]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert patch.flex_attention_function() is flex_attention


def test_checkpointed_under_bf16_autocast_recomputes_in_bf16(flat_target, monkeypatch):
    """04's `--precision bf16` runs the forward under autocast and the backward outside it (as its
    Trainer does); the backward recomputes each step and tile under the forward's autocast (torch's
    checkpoint restores it): the same bits as activations kept from the forward."""
    monkeypatch.setattr(draft_forward, "TILE_TOKENS", 64)
    model = make_draft(flat_target)
    inputs = holed_inputs(model)

    def autocast(forward):
        def autocast_forward(*args, **kwargs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return forward(*args, **kwargs)
        return autocast_forward

    results = [run(model, autocast(draft_forward.make_forward(DraftLoss(), checkpointing)), inputs)
               for checkpointing in (False, True)]
    assert results[0].metrics["loss_0"].dtype == torch.float32  # the loss is taken in fp32 over bf16 logits
    assert_same(results[1], results[0])
