"""common/extract/hf_engine.py: the HF engine keeps, for layer id i, HF `hidden_states[i]` (the output
of decoder layer i-1) and the post-norm final state, each sample's own rows of a right-padded batch,
each in its own storage, encoded as the folder stores them; its hooks are gone after each batch."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama

from common.extract.hf_engine import StateExtractor, capture_layers
from common.hidden_states.storage import FP32_CHECK, SCALES_KEY, STORAGES

pytestmark = pytest.mark.usefixtures("one_thread")  # a tiny model computes fastest on one thread
LAYER_IDS = [1, 2, 3]  # of the 4-layer tiny Llama; the final state is hidden_states[4], after the norm


def random_ids(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_states(model: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return [out.hidden_states[i][0] for i in [*LAYER_IDS, len(out.hidden_states) - 1]]


def test_each_sample_of_a_padded_batch_gets_the_targets_own_states():
    model = tiny_llama()
    ids = random_ids([9, 3, 1, 6])
    stored = StateExtractor(model, LAYER_IDS, FP32_CHECK)(ids)
    assert len(stored) == len(ids)
    for sample, got in zip(ids, stored, strict=True):
        assert got.scales is None and [s.shape for s in got.states] == [(len(sample), 32)] * 4
        for state, expected in zip(got.states, hf_states(model, sample), strict=True):
            torch.testing.assert_close(state, expected, rtol=1e-4, atol=1e-5)  # as a forward of the sample alone
        # its own bytes, not a view of the padded batch (which would be saved whole into its file)
        assert sum(s.untyped_storage().nbytes() for s in got.states) == len(sample) * 4 * 32 * 4


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_states_are_encoded_as_the_folder_stores_them(storage):
    model = tiny_llama()
    ids = random_ids([5, 2], seed=1)
    (first, second) = StateExtractor(model, LAYER_IDS, STORAGES[storage])(ids)
    exact = hf_states(model, ids[0])
    assert all(s.dtype == STORAGES[storage].dtype and s.shape == (5, 32) for s in first.states)
    assert (first.scales is None) == (storage == "bf16") and second.states[0].shape == (2, 32)
    decoded = STORAGES[storage].decode({"hidden_states": first.states, SCALES_KEY: first.scales})
    for back, ref in zip(decoded, exact, strict=True):
        assert float((back.float() - ref).norm() / ref.norm()) < 0.05


def test_the_hooks_are_removed_after_each_batch_also_after_an_error():
    model = tiny_llama()
    layers = model.model.layers
    extractor = StateExtractor(model, LAYER_IDS)
    extractor(random_ids([4]))
    assert not any(layer._forward_hooks for layer in layers)
    with pytest.raises(RuntimeError, match="stopped"), capture_layers(layers, [2]) as captured:
        model(input_ids=torch.tensor([[1, 2, 3]]))
        assert set(captured) == {2}
        raise RuntimeError("stopped")
    assert not any(layer._forward_hooks for layer in layers)
    assert extractor.forward_seconds > 0
