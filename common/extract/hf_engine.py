"""Capturing a target's hidden states for EAGLE-3 training in this process, with transformers
(step 02's `--engine hf`, 04 --online's too).

Only four states are kept: three auxiliary layers and the post-norm final state. Layer id i
(vLLM convention, docs/FILES.md) is HF `hidden_states[i]`, the output of decoder layer i-1; a
forward hook on that layer keeps it. The final state is the output of the base model
(`model.model`, its final norm applied), so the 163840-wide logits are never computed and
`output_hidden_states` (all N+1 layers of a long batch held at once) is never used. A batch is
right-padded with an attention mask (common/extract/batches.py plans them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES, StateStorage, StoredStates
from common.target.model import decoder_parts


@contextmanager
def capture_layers(layers: torch.nn.ModuleList, layer_ids: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks keeping the output of decoder layer i-1 as state i, for each requested id."""
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int):
        def hook(_module, _args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [layers[i - 1].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class StateExtractor:
    """Runs batches through the base model and returns each sample's four states on the CPU,
    encoded for storage on the model's device (fp8 moves half the bytes off a GPU)."""

    PAD_ID = 0  # any valid id: padded positions come after every real token and are dropped

    def __init__(self, model: torch.nn.Module, layer_ids: list[int],
                 storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> None:
        self.base, self.layers = decoder_parts(model)
        self.layer_ids = layer_ids
        self.storage = storage
        self.device = self.base.get_input_embeddings().weight.device
        self.forward_seconds = 0.0

    @torch.inference_mode()
    def __call__(self, id_lists: list[list[int]]) -> list[StoredStates]:
        """Per sample: [aux states..., final state], each [S, H] encoded for storage on the CPU,
        each with its own storage (a view would save the whole batch into the file)."""
        longest = max(map(len, id_lists))
        ids = torch.full((len(id_lists), longest), self.PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sample in enumerate(id_lists):
            ids[row, :len(sample)] = torch.tensor(sample)
            mask[row, :len(sample)] = 1
        start = time.perf_counter()
        with capture_layers(self.layers, self.layer_ids) as captured:
            final = self.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                              use_cache=False).last_hidden_state
        _sync(final)
        self.forward_seconds += time.perf_counter() - start
        states, scales = self.storage.encode([captured[i] for i in self.layer_ids] + [final])
        states = [s.cpu() for s in states]
        scales = scales.cpu() if scales is not None else None
        return [StoredStates([s[row, :n].clone() for s in states],
                             scales[:, row, :n].clone() if scales is not None else None)
                for row, n in enumerate(map(len, id_lists))]

