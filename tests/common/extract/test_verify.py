"""common/extract/verify.py: stored states checked against a plain forward of the target. The target's
own states pass with no error; an auxiliary state of another layer, or a final state that is not the
sample's, is caught."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama

from common.extract.verify import verify_samples

pytestmark = pytest.mark.usefixtures("one_thread")  # a tiny model computes fastest on one thread
LAYER_IDS = [1, 2, 3]


@torch.inference_mode()
def own_states(model: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """[aux..., final] as 02 stores them: HF hidden_states[i], then the post-norm last state."""
    hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states
    return [hidden[i][0].clone() for i in [*LAYER_IDS, len(hidden) - 1]]


def samples(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def test_the_targets_own_states_pass():
    model = tiny_llama()
    pairs = [(ids, own_states(model, ids)) for ids in samples([12, 5, 30])]
    check = verify_samples(model, pairs, LAYER_IDS)
    assert check.tokens == 47 and check.argmax_agreement == 1.0 and check.unexplained_mismatches == 0
    assert check.max_logit_diff < 1e-4 and check.max_aux_error < 1e-6


def test_an_auxiliary_state_of_another_layer_is_caught():
    model = tiny_llama()
    ids = samples([20])[0]
    states = own_states(model, ids)
    states[0] = states[1]  # layer 2's state stored as layer 1's (an off-by-one in the hooks)
    check = verify_samples(model, [(ids, states)], LAYER_IDS)
    assert check.max_aux_error > 0.1
    assert check.argmax_agreement == 1.0 and check.max_logit_diff < 1e-4  # the final state is still right


def test_a_final_state_of_other_tokens_is_caught():
    model = tiny_llama()
    ids, other = samples([40, 40], seed=2)
    states = own_states(model, ids)
    states[-1] = own_states(model, other)[-1]  # another sample's final state
    check = verify_samples(model, [(ids, states)], LAYER_IDS)
    assert check.argmax_agreement < 0.5 and check.max_logit_diff > 0.1 and check.max_aux_error < 1e-6
