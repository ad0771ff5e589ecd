"""common/draft/patch.py against the unpatched speculators 0.3.0: the Kimi-K2.5 embeddings/lm_head
setup, the CPU attention fallback, the device-agnostic checkpointer, the eager forward, the loss
over the verifier's softmax computed once per batch, and the other divergences against their
definitions."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import save_file
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3 import core as eagle3_core
from speculators.models.eagle3.attention import ALL_ATTENTION_FUNCTIONS, flex_attention_forward
from speculators.train import trainer as library_trainer
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from speculators.utils.loading import load_model_layers
from torch.distributions import Categorical, kl_divergence
from transformers import AutoConfig

from common.draft import patch
from common.draft.model import DraftShape, speculator_config
from common.target.config import TargetError, load_target_info, read_tensors

SHAPE = DraftShape(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128)
DRAFT_VOCAB = 256


def vocab_maps(vocab_size: int, draft_vocab: int = DRAFT_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(t2d, d2t) keeping every third id, through speculators' own mapping function."""
    counts = {i * 3: 1 for i in range(draft_vocab)}
    d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab, vocab_size)
    return t2d, d2t


def make_draft(target, shape: DraftShape = SHAPE, t2d_size: int | None = None) -> Eagle3DraftModel:
    info = load_target_info(target, trust_remote_code=True)
    t2d, d2t = vocab_maps(t2d_size or info.vocab_size)
    config = speculator_config(shape, info, DRAFT_VOCAB, info.default_layer_ids(), speculative_tokens=3)
    torch.manual_seed(0)
    return Eagle3DraftModel(config, t2d, d2t)


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
        make_draft(kimi_target, DraftShape(**{**SHAPE.__dict__, "hidden_size": 32, "head_dim": 8}))
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
    assert eagle3_core.compute_metrics is patch.compute_metrics
    patch.apply(compile_forward=True)
    assert Eagle3DraftModel.forward is patch.ORIGINAL_FORWARD  # the library's compiled forward
    assert hasattr(patch.ORIGINAL_FORWARD, "_torchdynamo_orig_callable")
    assert eagle3_core.compute_metrics is patch.ORIGINAL_COMPUTE_METRICS  # compiled: the library's loss
    patch.apply(trust_remote_code=True, compile_forward=False)


def draft_inputs(seq: int = 256, hidden: int = 64, vocab: int = 4000) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, seq, 3 * hidden, generator=g),
            "input_ids": torch.randint(0, vocab, (1, seq), generator=g),
            "lengths": torch.tensor([100, 120, 30]),  # three packed samples, then padding
            "loss_mask": torch.ones(1, seq, dtype=torch.long),
            "position_ids": torch.arange(seq).unsqueeze(0),
            "verifier_last_hidden_states": torch.randn(1, seq, hidden, generator=g),
            "ttt_steps": 3}


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
    model = make_draft(flat_target, dataclasses.replace(SHAPE, num_hidden_layers=2))  # two layers: one mask per step
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
    ours, our_metrics = train_steps(flat_target, patch.compute_metrics, monkeypatch, off_policy)
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
    for ttt_step in range(3):
        ours_prev, theirs_prev = torch.ones(1, 40, dtype=torch.bool), torch.ones(1, 40, dtype=torch.bool)
        ours_prev[:, ::5] = theirs_prev[:, ::5] = False
        ours = patch.compute_metrics(logits, targets, None, ours_prev, ttt_step, 0.8)
        theirs = patch.ORIGINAL_COMPUTE_METRICS(logits, targets, None, theirs_prev, ttt_step, 0.8)
        assert torch.isfinite(ours[0]) and ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-5)
        assert torch.equal(ours_prev, theirs_prev)
        for name in (f"full_acc_{ttt_step}", f"cond_acc_{ttt_step}"):
            assert torch.equal(ours[1][name], theirs[1][name])
        our_grad, = torch.autograd.grad(ours[0], logits)
        their_grad, = torch.autograd.grad(theirs[0], logits)
        assert torch.equal(our_grad, their_grad)


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
@pytest.mark.parametrize("loss", patch.LOSSES)
def test_each_loss_is_its_definition_masked_decayed_and_differentiated(loss, temperature):
    """Value and gradient of every TTT step's loss: the masked mean over tokens of the divergence
    to the target's distribution at `temperature` (softmax(logits / T)), times decay**step, with
    the targets shifted as the library aligns them. The accuracies compare the draft's argmax
    with the target's, which no temperature changes."""
    patch.apply(trust_remote_code=True, compile_forward=False, loss=loss, target_temperature=temperature)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 30, 40, generator=g).mul(2).requires_grad_()
    targets = torch.randn(1, 30, 40, generator=g) * 3
    mask = (torch.rand(1, 30, generator=g) > 0.3).long()
    for step in range(3):
        ours, metrics = patch.compute_metrics(logits, targets, mask, torch.ones(1, 30, dtype=torch.bool), step, 0.8)
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
        loss, _ = patch.compute_metrics(logits, targets, None, None, 0, 1.0)
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
        value = {name: patch.compute_metrics(draft, targets, None, None, 0, 1.0)[0].item()
                 for name, draft in (("same", targets), ("close", close), ("far", far))}
        assert value["same"] == pytest.approx(0.0, abs=1e-6)
        assert value["close"] == pytest.approx(0.1 if loss == "tv" else -math.log(0.9), rel=1e-5)
        assert value["far"] == pytest.approx(expected_far, rel=1e-5)


def test_an_unknown_loss_is_refused_and_compiled_kl_keeps_the_library_s():
    with pytest.raises(ValueError, match="loss 'ce': expected one of kl, tv, lk, lk-hybrid, jsd, rkl"):
        patch.apply(loss="ce")
    patch.apply(compile_forward=True, loss="tv")  # compiled with another loss: ours, which the compiler can trace
    assert eagle3_core.compute_metrics is patch.compute_metrics
    patch.apply(compile_forward=True, target_temperature=0.5)  # the library's knows no temperature: ours
    assert eagle3_core.compute_metrics is patch.compute_metrics
    with pytest.raises(ValueError, match="target_temperature 0: must be positive"):
        patch.apply(target_temperature=0)
    patch.apply(compile_forward=True)
    assert eagle3_core.compute_metrics is patch.ORIGINAL_COMPUTE_METRICS


@pytest.mark.parametrize("loss", patch.LOSSES)
def test_every_loss_compiles_in_one_graph(loss):
    """On GPUs the forward is compiled: every loss traces without a graph break (the per-batch cache
    is skipped under the compiler) and gives the eager value and gradient. aot_eager: dynamo and
    autograd's tracing without inductor's code generation, which a CPU test need not pay for."""
    patch.apply(compile_forward=True, loss=loss, target_temperature=0.7)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 20, 30, generator=g, requires_grad=True)
    targets, mask = torch.randn(1, 20, 30, generator=g), torch.ones(1, 20, dtype=torch.long)
    compiled = torch.compile(patch.compute_metrics, backend="aot_eager", fullgraph=True)
    ours, _ = compiled(logits, targets, mask, torch.ones(1, 20, dtype=torch.bool), 1, 0.8)
    our_grad, = torch.autograd.grad(ours, logits)
    eager, _ = patch.compute_metrics(logits, targets, mask, torch.ones(1, 20, dtype=torch.bool), 1, 0.8)
    eager_grad, = torch.autograd.grad(eager, logits)
    assert ours.item() == pytest.approx(eager.item(), rel=1e-6)
    assert torch.allclose(our_grad, eager_grad, rtol=1e-5, atol=1e-8)
