"""common/draft/model.py: the exported draft folder and its loader, for a draft vocabulary smaller than
the target's and for the target's whole one (03's identity map), which vLLM serves only without
`d2t` (that it does: tests/test_vllm.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import DRAFT_SHAPE
from safetensors import safe_open
from safetensors.torch import save_file

from common.draft import patch
from common.draft.model import build_draft, export_draft, identity_maps, load_draft, speculator_config
from common.errors import PipelineError
from common.target.config import load_target_info
from common.vocab import build_maps


@pytest.fixture(autouse=True)
def patched():
    patch.apply(trust_remote_code=True, compile_forward=False)


def exported(target, folder, draft_vocab: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A random draft over the `draft_vocab` most frequent ids (as 03 picks them), exported to
    `folder`: (the model, the exported tensors)."""
    info = load_target_info(target, trust_remote_code=True)
    counts = torch.arange(info.vocab_size, 0, -1)
    d2t, t2d = build_maps(counts, draft_vocab)
    config = speculator_config(DRAFT_SHAPE, info, draft_vocab, info.default_layer_ids(), speculative_tokens=3)
    torch.manual_seed(0)
    model = build_draft(config, t2d, d2t)
    checkpoint = folder.parent / f"{folder.name}-checkpoint"
    checkpoint.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(checkpoint / "model.safetensors"))
    export_draft(checkpoint, config, folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return model, {k: f.get_tensor(k) for k in f.keys()}


def test_a_draft_over_the_whole_vocabulary_is_written_without_maps_and_reloads(flat_target, tmp_path):
    model, saved = exported(flat_target, tmp_path / "draft", draft_vocab=4096)
    assert torch.equal(model.t2d, identity_maps(4096)["t2d"]) and not model.d2t.any()
    # what vLLM's Eagle3LlamaForCausalLM loads when draft_vocab_size == vocab_size: no d2t (nor t2d)
    assert "d2t" not in saved and "t2d" not in saved and "fc.weight" in saved
    loaded = load_draft(tmp_path / "draft", target=flat_target)
    assert torch.equal(loaded.t2d, model.t2d) and torch.equal(loaded.d2t, model.d2t)
    assert loaded.lm_head.weight.shape == (4096, 64)
    for name, tensor in saved.items():
        assert torch.equal(loaded.state_dict()[name], tensor.float()), name


def test_a_smaller_draft_vocabulary_keeps_its_maps(flat_target, tmp_path):
    model, saved = exported(flat_target, tmp_path / "draft", draft_vocab=1000)
    assert torch.equal(saved["d2t"], model.d2t) and torch.equal(saved["t2d"], model.t2d)
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    loaded = load_draft(tmp_path / "draft", target=flat_target)
    assert torch.equal(loaded.d2t, model.d2t)


def test_a_smaller_draft_vocabulary_without_maps_is_refused(flat_target, tmp_path):
    _, saved = exported(flat_target, tmp_path / "draft", draft_vocab=1000)
    save_file({k: v for k, v in saved.items() if k not in ("t2d", "d2t")}, str(tmp_path / "draft" / "model.safetensors"))
    with pytest.raises(PipelineError, match=r"draft .*draft: model.safetensors holds no t2d/d2t vocabulary maps, "
                                            r"which a draft vocabulary of 1,000 of the target's 4,096 ids needs"):
        load_draft(tmp_path / "draft", target=flat_target)
