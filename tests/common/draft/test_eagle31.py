"""common/draft/eagle31.py: EAGLE-3.1's norms on the library's draft: what flows through fc, the last
layer and the final norm, the config vLLM reads, the exported folder and a resume of another shape.
(That vLLM serves such a draft as 05 decodes it: tests/test_vllm.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import DRAFT_SHAPE, SMALL_DRAFT_VOCAB, make_draft
from safetensors.torch import save_file

from common.draft import eagle31, patch
from common.draft.model import config_differences, export_draft, load_draft, read_saved_config, speculator_config
from common.target.config import load_target_info

EAGLE31 = dataclasses.replace(DRAFT_SHAPE, norm_before_fc=True, norm_output=True)


@pytest.fixture(autouse=True)
def patched():
    patch.apply(trust_remote_code=True, compile_forward=False)


def randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights away from 1, so that a norm applied twice or not at all shows."""
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = 0.5 + torch.rand(p.shape, generator=g)


def layer_inputs(model: torch.nn.Module, seq: int = 6) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, seq, 2 * model.hidden_size, generator=g)
    position_ids = torch.arange(1, seq + 1).unsqueeze(0)
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq)
    model.layers[0].self_attn.config._attn_implementation = "sdpa"
    return x, {"attention_mask": causal, "position_ids": position_ids,
               "position_embeddings": model.rotary_emb(x, position_ids)}


def test_input_norm_is_applied_before_fc(flat_target):
    model = make_draft(flat_target, EAGLE31)
    eagle31.install(model, norm_before_fc=True, norm_output=False)
    randomise_norms(model)
    aux = torch.randn(1, 5, 3 * model.hidden_size)
    expected = model.input_norm.weight * aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) +
                                                           model.input_norm.variance_epsilon)
    assert model.input_norm.weight.shape == (3 * model.hidden_size,)
    assert torch.allclose(model.fc(aux), torch.nn.functional.linear(expected, model.fc.weight), atol=1e-6)


def test_norm_output_hands_the_next_step_the_normed_state_and_normalises_once(flat_target):
    model = make_draft(flat_target, EAGLE31)
    eagle31.install(model, norm_before_fc=False, norm_output=True)
    randomise_norms(model)
    x, kwargs = layer_inputs(model)
    with torch.no_grad():
        pre_norm = model.layers[-1].forward(x, **kwargs)  # the layer without its hook: h
        handed_on = model.layers[-1](x, **kwargs)  # what the next step reads
        assert torch.equal(handed_on, model.norm.forward(pre_norm))
        assert not torch.allclose(handed_on, pre_norm)
        # lm_head(norm(...)) as the library and 05 write it: norm(h), not norm(norm(h))
        assert torch.equal(model.norm(handed_on), handed_on)


def test_config_vllm_reads_and_the_exported_draft_round_trip(flat_target, tmp_path):
    info = load_target_info(flat_target, trust_remote_code=True)
    model = make_draft(flat_target, EAGLE31)
    eagle31.install(model, norm_before_fc=True, norm_output=True)
    randomise_norms(model)
    config = speculator_config(EAGLE31, info, SMALL_DRAFT_VOCAB, info.default_layer_ids(), speculative_tokens=5)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(checkpoint / "model.safetensors"))
    folder = export_draft(checkpoint, config, tmp_path / "draft")
    saved = json.loads((folder / "config.json").read_text())
    # the keys vLLM's speculators config reads (transformers_utils/configs/speculators/algos.py, update_eagle3)
    assert (saved["norm_before_fc"], saved["norm_output"], saved["norm_before_residual"]) == (True, True, True)
    assert saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    loaded = load_draft(folder, target=flat_target)
    assert eagle31.norms_of(loaded.config) == {"norm_before_fc": True, "norm_output": True}
    assert torch.equal(loaded.input_norm.weight, model.input_norm.weight.to(torch.bfloat16).float())
    aux = torch.randn(1, 4, 3 * model.hidden_size)
    assert torch.allclose(loaded.fc(aux), loaded.fc.forward(loaded.input_norm(aux)))


def test_a_draft_of_the_other_shape_differs_for_resume(flat_target):
    info = load_target_info(flat_target, trust_remote_code=True)
    plain = speculator_config(DRAFT_SHAPE, info, SMALL_DRAFT_VOCAB, info.default_layer_ids(), speculative_tokens=3)
    normed = speculator_config(EAGLE31, info, SMALL_DRAFT_VOCAB, info.default_layer_ids(), speculative_tokens=3)
    assert config_differences(plain, normed) == ["norm_before_fc False there, True now",
                                                 "norm_output False there, True now"]
    assert config_differences(normed, normed) == []


def test_drafts_saved_before_the_norms_load_without_them(flat_target, tmp_path):
    info = load_target_info(flat_target, trust_remote_code=True)
    config = speculator_config(DRAFT_SHAPE, info, SMALL_DRAFT_VOCAB, info.default_layer_ids(), speculative_tokens=3)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in eagle31.NORMS:  # as written before EAGLE-3.1: no such keys
        saved.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert eagle31.norms_of(read_saved_config(tmp_path)) == {"norm_before_fc": False, "norm_output": False}
