"""common/extract/vllm_engine.py: vLLM's states become the files the HF engine writes. The auxiliary
layers are kept as vLLM gives them; the final norm the target applies (vLLM hands back the last
layer before it) is applied in fp32; states of other tokens or another layer count are refused. Over
a hidden-state server by URL (04 --online --vllm-url), a server of another layer choice is refused
before any extraction. No engine starts here: the server's extraction is replaced (helpers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import hidden_state_server

from common.engine_device import Runtime
from common.errors import PipelineError
from common.extract.vllm_engine import VllmStateExtractor, open_vllm_extractor
from common.hidden_states.storage import FP32_CHECK, STORAGES
from common.target.config import load_target_info
from common.target.model import load_text_model

HIDDEN = 16
LAYER_IDS = [2, 4, 5]


def vllm_states(ids: list[int], hidden: int = HIDDEN) -> torch.Tensor:
    """[S, 4, H] as vLLM's connector gives them: the auxiliary layers, then the last layer, pre-norm."""
    g = torch.Generator().manual_seed(sum(ids))
    return torch.randn(len(ids), len(LAYER_IDS) + 1, hidden, generator=g) * 4


def test_aux_states_are_kept_and_the_final_one_gets_the_targets_norm():
    weight, eps = torch.rand(HIDDEN, generator=torch.Generator().manual_seed(1)) + 0.5, 1e-6
    fetched = []

    def fetch(id_lists):
        fetched.append(id_lists)
        return [(vllm_states(ids), torch.tensor(ids)) for ids in id_lists]

    extractor = VllmStateExtractor(fetch, LAYER_IDS, (weight, eps), FP32_CHECK)
    prompts = [[3, 1, 4, 1], [5, 9]]
    stored = extractor(prompts)
    assert fetched == [prompts]  # one request for the batch
    for ids, got in zip(prompts, stored, strict=True):
        raw = vllm_states(ids)
        assert got.scales is None and len(got.states) == 4
        for j in range(len(LAYER_IDS)):
            assert torch.equal(got.states[j], raw[:, j])
        torch.testing.assert_close(got.states[-1], F.rms_norm(raw[:, -1], (HIDDEN,), weight, eps))
    fp8 = VllmStateExtractor(fetch, LAYER_IDS, (weight, eps), STORAGES["fp8"])([[2, 7, 1]])[0]
    assert [s.dtype for s in fp8.states] == [torch.float8_e4m3fn] * 4 and fp8.scales.shape == (4, 3)


@pytest.mark.parametrize(("answer", "message"), [
    (lambda ids: (vllm_states(ids), torch.tensor(ids[::-1])), r"vLLM gave states \(3, 4, 16\) for 3 tokens"),
    (lambda ids: (vllm_states(ids)[:, :3], torch.tensor(ids)), r"vLLM gave states \(3, 3, 16\) for 3 tokens"),
    (lambda ids: (vllm_states(ids)[:2], torch.tensor(ids[:2])), r"vLLM gave states \(2, 4, 16\) for 2 tokens"),
])
def test_states_of_other_tokens_or_layers_are_refused(answer, message):
    extractor = VllmStateExtractor(lambda id_lists: [answer(ids) for ids in id_lists], LAYER_IDS,
                                   (torch.ones(HIDDEN), 1e-6), FP32_CHECK)
    with pytest.raises(PipelineError, match=rf"^{message}, expected 3 tokens x 4 layers"):
        extractor([[7, 8, 9]])


def test_over_a_server_the_files_hold_the_targets_post_norm_state(flat_target, tmp_path, monkeypatch):
    info = load_target_info(flat_target)

    def states_of(ids):
        return vllm_states(ids, info.hidden_size)

    with hidden_state_server(monkeypatch, tmp_path / "scratch", info.path, [1, 2, 3, 8], states_of) as url:
        runtime = Runtime(engine="vllm", vllm_url=url)
        with pytest.raises(PipelineError, match=r"extracts layers \[1, 2, 3, 8\], this run needs \[2, 4, 5, 8\]"):
            with open_vllm_extractor(runtime, info, False, LAYER_IDS, FP32_CHECK, tmp_path / "out", 64, (0, 1)):
                pass
    with hidden_state_server(monkeypatch, tmp_path / "scratch", info.path, [*LAYER_IDS, 8], states_of) as url:
        runtime = Runtime(engine="vllm", vllm_url=url)
        with open_vllm_extractor(runtime, info, False, LAYER_IDS, FP32_CHECK, tmp_path / "out", 64, (0, 1)) as engine:
            (stored,) = engine([[11, 12, 13, 14, 15]])
    raw = states_of([11, 12, 13, 14, 15])
    assert torch.equal(stored.states[1], raw[:, 1])
    with torch.inference_mode():
        own_norm = load_text_model(info).model.norm(raw[:, -1])
    torch.testing.assert_close(stored.states[-1], own_norm, rtol=1e-5, atol=1e-5)
    assert not (tmp_path / "out").exists()  # nothing of the server's states is written here
