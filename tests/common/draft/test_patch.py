"""common/draft/patch.py against the unpatched speculators 0.3.0: the Kimi-K2.5 embeddings/lm_head
setup, the CPU attention fallback, the device-agnostic checkpointer, the eager forward, and what
`apply` installs. (The loss it installs: test_loss.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import DRAFT_SHAPE, draft_inputs, installed_loss, make_draft, vocab_maps
from safetensors.torch import save_file
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3 import core as eagle3_core
from speculators.models.eagle3.attention import ALL_ATTENTION_FUNCTIONS, flex_attention_forward
from speculators.train import trainer as library_trainer
from speculators.utils.loading import load_model_layers
from transformers import AutoConfig

from common.draft import patch
from common.draft.model import DraftShape
from common.target.config import TargetError, read_tensors


@pytest.fixture(autouse=True)
def patched():
    patch.apply(trust_remote_code=True, compile_forward=False)


def unpatched_setup(monkeypatch) -> None:
    monkeypatch.setattr(Eagle3DraftModel, "_setup_embeddings_and_lm_heads", patch.ORIGINAL_SETUP)


FROZEN = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")


def test_flat_target_patched_equals_unpatched(flat_target, monkeypatch):
    patched_model = make_draft(flat_target)
    unpatched_setup(monkeypatch)
    library_model = make_draft(flat_target)
    ours, theirs = patched_model.state_dict(), library_model.state_dict()
    for name in FROZEN:
        assert torch.equal(ours[name], theirs[name]), name
    assert patched_model.embed_tokens.padding_idx == library_model.embed_tokens.padding_idx is not None
    assert not patched_model.embed_tokens.weight.requires_grad
    assert not patched_model.verifier_lm_head.weight.requires_grad


def test_kimi_target_fails_unpatched_as_in_the_story(kimi_target, monkeypatch):
    unpatched_setup(monkeypatch)
    # 1. the top-level config is remote code, read without trust_remote_code
    with pytest.raises(ValueError, match="trust_remote_code"):
        make_draft(kimi_target)
    # 2. even with the remote code trusted, the fields are under text_config
    monkeypatch.setattr(eagle3_core, "AutoConfig", type("TrustingAutoConfig", (), {
        "from_pretrained": staticmethod(lambda path: AutoConfig.from_pretrained(path, trust_remote_code=True))}))
    with pytest.raises(AttributeError, match="hidden_size"):
        make_draft(kimi_target)
    # 3. and the weights are under language_model., not the keys the library asks for
    with pytest.raises(ValueError, match="None of the requested tensor names"):
        load_model_layers(["model.embed_tokens.weight", "lm_head.weight"], str(kimi_target))


def test_kimi_target_patched_reads_only_its_two_tensors(kimi_target, monkeypatch):
    requested = []

    def spy(path, names):
        requested.append(list(names))
        return read_tensors(path, names)

    monkeypatch.setattr(patch, "read_tensors", spy)
    model = make_draft(kimi_target)
    assert requested == [["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"]]
    weights = read_tensors(kimi_target, requested[0])
    t2d, _ = vocab_maps(163840)
    assert torch.equal(model.embed_tokens.weight, weights["language_model.model.embed_tokens.weight"].float())
    assert torch.equal(model.lm_head.weight, weights["language_model.lm_head.weight"].float()[t2d])
    assert torch.equal(model.verifier_lm_head.weight, model.lm_head.weight)
    assert model.embed_tokens.padding_idx == 163839  # Kimi's [PAD], from text_config


def test_drafts_share_one_read_of_the_target_inside_the_block(kimi_target, monkeypatch):
    """05 builds up to three drafts on one target: inside `target_weights_read_once` the embedding
    and lm_head are read once and every draft gets the same values; outside, each build reads."""
    requested = []

    def spy(path, names):
        requested.append(list(names))
        return read_tensors(path, names)

    monkeypatch.setattr(patch, "read_tensors", spy)
    with patch.target_weights_read_once():
        drafts = [make_draft(kimi_target) for _ in range(3)]
    assert len(requested) == 1
    for draft in drafts[1:]:
        assert torch.equal(draft.embed_tokens.weight, drafts[0].embed_tokens.weight)
        assert torch.equal(draft.verifier_lm_head.weight, drafts[0].verifier_lm_head.weight)
    drafts[1].lm_head.weight.data.add_(1.0)  # a trainable copy each: one draft's change stays its own
    assert not torch.equal(drafts[1].lm_head.weight, drafts[0].lm_head.weight)
    make_draft(kimi_target)
    assert len(requested) == 2  # nothing kept after the block


def test_library_checks_are_kept(kimi_target):
    with pytest.raises(TargetError, match="hidden size 64 does not match the draft's hidden size 32"):
        make_draft(kimi_target, DraftShape(**{**DRAFT_SHAPE.__dict__, "hidden_size": 32, "head_dim": 8}))
    with pytest.raises(TargetError, match="vocabulary of 163840 ids, but t2d has 1000 entries"):
        make_draft(kimi_target, t2d_size=1000)


def test_missing_weights_error_lists_the_keys_searched(tmp_path):
    save_file({"language_model.model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TargetError) as error:
        patch.find_weight_keys(tmp_path, "language_model.")
    assert "language_model.model.embed_tokens.weight" in str(error.value)
    assert "'model.embed_tokens.weight'" in str(error.value)


def test_tied_lm_head_falls_back_to_the_embedding(tmp_path):
    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(tmp_path / "model.safetensors"))
    assert patch.find_weight_keys(tmp_path, "") == ("model.embed_tokens.weight", "model.embed_tokens.weight")


def test_apply_is_idempotent_and_installs_every_fix():
    patch.apply(trust_remote_code=True, compile_forward=False)
    patch.apply(trust_remote_code=True, compile_forward=False)
    assert ALL_ATTENTION_FUNCTIONS[patch.ATTENTION_NAME] is patch.attention_forward
    assert library_trainer.SingleGPUCheckpointer is patch.DeviceAgnosticCheckpointer
    assert not hasattr(Eagle3DraftModel.forward, "_torchdynamo_orig_callable")  # eager
    loss = installed_loss()  # ours, at apply's default loss and temperature
    assert loss is not None and (loss.name, loss.target_temperature) == ("kl", 1.0)
    patch.apply(compile_forward=True)
    assert Eagle3DraftModel.forward is patch.ORIGINAL_FORWARD  # the library's compiled forward
    assert hasattr(patch.ORIGINAL_FORWARD, "_torchdynamo_orig_callable")
    assert eagle3_core.compute_metrics is patch.ORIGINAL_COMPUTE_METRICS  # compiled: the library's loss
    patch.apply(trust_remote_code=True, compile_forward=False)


def test_dense_attention_equals_flex_attention_and_has_a_backward(flat_target):
    """Same metrics and draft tokens as the library's FlexAttention (forward only: that is what
    FlexAttention can do on CPU), over a sequence that is a multiple of its 128-token blocks."""
    model = make_draft(flat_target)
    inputs = draft_inputs(vocab=model.embed_tokens.num_embeddings)
    with torch.no_grad():
        ours = model(**inputs)
        ALL_ATTENTION_FUNCTIONS.register(patch.ATTENTION_NAME, flex_attention_forward)
        try:
            theirs = model(**inputs)
        finally:
            patch.apply(trust_remote_code=True, compile_forward=False)
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))
    for name, value in theirs[2].items():
        assert torch.allclose(ours[2][name], value, rtol=1e-4, atol=1e-5), name
    _tokens, loss, _metrics = model(**inputs)
    loss.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0


def boolean_mask_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The CPU attention as it was: the whole boolean mask from `mask_mod` at every call, which
    SDPA turns into an additive one itself."""
    mask = patch.dense_mask(attention_mask.mask_mod, query.shape[-2], 0, key.shape[-2], query.device)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def forward_and_gradients(model, inputs) -> tuple:
    model.zero_grad()
    tokens, loss, metrics = model(**inputs)
    loss.backward()
    return tokens, metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_cpu_mask_made_once_per_forward_changes_no_bit(flat_target, monkeypatch):
    """The additive mask grown per TTT step, and the BlockMask left without its block structure
    on CPU, against the library's BlockMask and a boolean mask evaluated whole at every call."""
    model = make_draft(flat_target, dataclasses.replace(DRAFT_SHAPE, num_hidden_layers=2))  # two layers: one mask per step
    inputs = draft_inputs(vocab=model.embed_tokens.num_embeddings)
    ours = forward_and_gradients(model, inputs)
    monkeypatch.setattr(eagle3_core, "create_block_mask", patch.ORIGINAL_CREATE_BLOCK_MASK)
    ALL_ATTENTION_FUNCTIONS.register(patch.ATTENTION_NAME, boolean_mask_attention)
    try:
        theirs = forward_and_gradients(model, inputs)
    finally:
        patch.apply(trust_remote_code=True, compile_forward=False)
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))
    assert all(torch.equal(ours[1][k], v) for k, v in theirs[1].items())
    assert ours[2].keys() == theirs[2].keys() and all(torch.equal(ours[2][k], v) for k, v in theirs[2].items())


def test_checkpointer_resumes_on_cpu(flat_target, tmp_path):
    model = make_draft(flat_target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _tokens, loss, _metrics = model(**draft_inputs(vocab=model.embed_tokens.num_embeddings))
    loss.backward()
    optimizer.step()
    patch.ORIGINAL_CHECKPOINTER(tmp_path).save_checkpoint(model, optimizer, 0)

    with pytest.raises((RuntimeError, AssertionError)):  # the library loads onto "cuda:0"
        patch.ORIGINAL_CHECKPOINTER(tmp_path).load_model_state_dict(make_draft(flat_target))
    fresh = make_draft(flat_target)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    checkpointer = patch.DeviceAgnosticCheckpointer(tmp_path)
    checkpointer.load_model_state_dict(fresh)
    checkpointer.load_optimizer_state_dict(fresh, fresh_optimizer)
    assert torch.equal(fresh.fc.weight, model.fc.weight.to(torch.bfloat16).float())  # saved in bf16
    assert fresh_optimizer.state_dict()["state"][0]["exp_avg"].shape == model.fc.weight.shape
