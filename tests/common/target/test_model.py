"""common/target/model.py: the text model of either miniature builds and runs like the real one
(nested weights under language_model., INT4 experts kept packed)."""

from __future__ import annotations

import pytest
import torch

from common.target.config import load_target_info
from common.target.model import load_text_model


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_target_info_and_text_model(kind, request):
    path = request.getfixturevalue(f"{kind}_target")
    info = load_target_info(path, trust_remote_code=True)
    assert info.hidden_size == 64 and info.num_layers == 8 and info.default_layer_ids() == [2, 4, 5]
    assert info.nested == (kind == "kimi")
    assert info.text_architecture == ("DeepseekV3ForCausalLM" if kind == "kimi" else "LlamaForCausalLM")
    model = load_text_model(info, dtype=torch.float32)
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], info.vocab_size)
    assert len(out.hidden_states) == info.num_layers + 1
    if kind == "kimi":  # like a trained model, it predicts ids its tokenizer makes, not one of 160K unused ids
        n_bpe = len((path / "tiktoken.model").read_text().splitlines())
        pred = out.logits.argmax(-1)
        assert ((pred < n_bpe) | (pred >= 163584)).all()
