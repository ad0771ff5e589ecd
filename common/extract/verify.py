"""`Verification`: stored states checked against a plain forward of the target (bench/gpu_check_02.py,
the tests of step 02): the final state must give the target's logits through its lm_head, and each
auxiliary state must be HF `hidden_states[i]`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verification:
    """Stored states against a plain forward of the target (`output_hidden_states=True`)."""
    tokens: int
    max_logit_diff: float  # |lm_head(stored final state) - the target's own logits|
    argmax_agreement: float  # share of positions where both pick the same token
    unexplained_mismatches: int  # argmax differences not within the logit error of a near-tie
    max_aux_error: float  # max |stored aux - hidden_states[i]|, relative to max |hidden_states[i]|


@torch.inference_mode()
def verify_samples(model: torch.nn.Module, states: list[tuple[list[int], list[torch.Tensor]]],
                   layer_ids: list[int]) -> Verification:
    """Check (input ids, [aux..., final]) pairs against the target: `lm_head(final)` must give
    the target's logits and aux state i must be HF `hidden_states[i]`."""
    tokens = agree = unexplained = 0
    max_diff = max_aux = 0.0
    device = model.get_input_embeddings().weight.device
    for ids, stored in states:
        out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
        own = out.logits[0].float()
        mine = model.lm_head(stored[-1].to(device, model.lm_head.weight.dtype)).float()
        diff = (own - mine).abs().max(dim=-1).values
        top, pick = own.argmax(-1), mine.argmax(-1)
        # A different pick is explained when the target itself rates it within the error of its top.
        gap = own.gather(-1, top[:, None])[:, 0] - own.gather(-1, pick[:, None])[:, 0]
        unexplained += int(((top != pick) & (gap > 2 * diff)).sum())
        agree += int((top == pick).sum())
        tokens += len(ids)
        max_diff = max(max_diff, float(diff.max()))
        for layer_id, state in zip(layer_ids, stored):
            ref = out.hidden_states[layer_id][0].float()
            max_aux = max(max_aux, float((state.to(ref.device).float() - ref).abs().max() / ref.abs().max()))
    return Verification(tokens, max_diff, agree / tokens, unexplained, max_aux)
