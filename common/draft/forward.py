"""The draft's training and validation forward with activation checkpointing: speculators 0.3.0's
`Eagle3DraftModel.forward` (the same TTT loop, arguments and results) with each TTT step recomputed in
the backward pass instead of kept, and each step's loss taken by tiles of tokens.

    from common.draft import patch
    patch.apply(..., activation_checkpointing=True)  # installs make_forward(DraftLoss(...))

Why, and at what cost:

- Checkpoint granularity: one TTT step. The library's backward keeps every activation of every step:
  each decoder layer's inputs, attention and MLP intermediates, and per step several [tokens x
  vocabulary] tensors (the draft's logits, their log-softmax, the verifier's softmax; on Kimi-K2.5's
  draft, 8,192 tokens x 32,000 ids x 4 bytes = 1 GB each). Here each step's body (concat, decoder
  layers, final norm; the frozen embedding's lookup stays outside, done once per forward when the
  steps read the dataset's tokens) runs under `torch.utils.checkpoint` (non-reentrant), so the
  backward keeps only what the step reads and hands on: its input state, its tokens, the earlier
  steps' keys/values and its own new ones, its output state and normed state ([tokens x hidden]
  each). The step's body is recomputed once when the backward reaches it: about one extra forward of
  each step, a third more compute in all. One step is the natural unit: it is the loop's body, its
  inputs are small, and the memory it frees grows with the TTT steps.
- Tiles: the loss of a step is taken by tiles of `TILE_TOKENS` draft positions, each under its own
  checkpoint: the draft's logits of the tile (lm_head over its normed states), the verifier's logits
  of the aligned rows (its lm_head over `verifier_last_hidden_states` shifted by the step, as the
  library's `align_for_step` aligns them), their softmax at the target temperature, the divergence
  summed over the tile's masked tokens and divided by the step's whole mask count (known up front:
  `common.draft.loss.mean_denominator`), and the argmaxes for accuracy and for the next step's
  tokens. No [tokens x vocabulary] tensor is ever formed whole nor kept for the backward: a tile's
  transients are a few [TILE_TOKENS x vocabulary] tensors (1,024 x 32,000 x 4 bytes = 131 MB each on
  Kimi-K2.5), and at 1,024 rows the lm_head matmul (1,024 x 7,168 x 32,000) still fills a GPU. The
  tiles sit beside the step's checkpoint, not inside it: nested inside, a tile's logits would be
  formed three times (forward, the step's recompute, the tile's recompute); beside it, twice, for
  the price of keeping the step's normed state (the same tensor as its output state under EAGLE-3.1's
  `norm_output`). The verifier's logits are formed per tile, twice per step (forward and recompute),
  where the library forms them once per batch: one more lm_head matmul per step and pass, the
  price of never holding the verifier's [tokens x vocabulary] distribution.
- Per-step cache: the library shares one transformers `DynamicCache` across steps, to which each
  layer's attention appends the step's keys/values; a recomputed step would append them twice. Each
  step here gets its own `StepCache`, made inside the step from the earlier steps' keys/values (the
  step's inputs): attention reads cat(earlier, new), and the step returns only its new keys/values,
  which the next steps take as inputs. Nothing outside the step is mutated by it, so recomputing it is
  harmless (on CPUs patch's cache of the dense attention mask may be extended or remade by a recomputed
  step: the same values); the RNG is not used in it (no dropout), so its state is not stashed.

What equals what (tests/common/draft/test_forward.py): with checkpointing off, this forward computes
what the library's does with a `DraftLoss` installed; a step of one tile is the same products in the
same order, so on a CPU in fp32 the loss, metrics, draft tokens and gradients are the same bits. With
several tiles per step the step's loss is a sum of tile sums, and lm_head's weight gradient a sum of
tile products: equal within float rounding. Checkpointing on recomputes the same operations on the
same inputs and leaves the autograd graph as it was, so on a CPU its loss, metrics and gradients are
the bits of the same forward with checkpointing off; on a GPU, where some kernels (atomic-add
reductions, autotuned matmuls) do not promise the same bits twice, they agree within rounding. The
accuracies compare argmaxes, so they are the library's exactly whenever the logits are.

Attention: on GPUs the layers' attention is FlexAttention compiled on its own (`common.draft.patch`),
since this forward, unlike the library's, is not compiled as a whole; on CPUs it is patch's SDPA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3 import core as library_core
from speculators.models.eagle3.attention import create_combined_mask_mod, extend_mask_for_draft_tokens
from torch.utils.checkpoint import checkpoint

from common.draft.loss import DraftLoss, accuracy_of, mean_denominator, step_loss, verifier_targets

# Draft positions per loss tile. Per tile the loss forms a few [TILE_TOKENS x draft vocabulary] tensors
# at once; 1,024 keeps them near 0.1 GB each at Kimi-K2.5's 32,000 ids, in 8 tiles of an 8,192-token pack,
# while each tile's lm_head matmul is still large enough to run at a GPU's full rate.
TILE_TOKENS = 1024


def make_forward(draft_loss: DraftLoss, checkpointing: bool = True) -> Callable:
    """An `Eagle3DraftModel.forward` (the library's arguments and results) training on `draft_loss`,
    each TTT step under activation checkpointing when `checkpointing` (and gradients are on)."""

    def forward(self: Eagle3DraftModel, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                lengths: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, verifier_last_hidden_states: torch.Tensor | None = None,
                ttt_steps: int = 3, ttt_step_loss_decay: float = 1.0, use_off_policy_tokens: bool = False,
                **kwargs):
        return draft_forward(self, hidden_states, input_ids, lengths, loss_mask, position_ids,
                             verifier_last_hidden_states, ttt_steps, ttt_step_loss_decay, use_off_policy_tokens,
                             draft_loss=draft_loss, checkpointing=checkpointing, layer_kwargs=kwargs)

    forward.draft_loss, forward.checkpointing = draft_loss, checkpointing  # what patch.apply installed
    return forward


def draft_forward(model: Eagle3DraftModel, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                  lengths: torch.Tensor | None, loss_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                  verifier_last_hidden_states: torch.Tensor | None, ttt_steps: int, ttt_step_loss_decay: float,
                  use_off_policy_tokens: bool, *, draft_loss: DraftLoss, checkpointing: bool,
                  layer_kwargs: dict) -> list[torch.Tensor] | tuple[list[torch.Tensor], torch.Tensor, dict]:
    """The library's TTT loop (see core.py's `Eagle3DraftModel.forward`), step by step as described
    in the module's docstring. Returns the draft tokens, or (draft tokens, loss, metrics) with the
    library's metric keys when `verifier_last_hidden_states` is given."""
    device = hidden_states.device
    total_seq_len = hidden_states.shape[1]
    if lengths is None:
        lengths = torch.tensor([total_seq_len], dtype=torch.long, device=device)
    if position_ids is None:
        position_ids = 1 + torch.arange(total_seq_len, dtype=torch.long, device=device).unsqueeze(0)
    mask_mod = create_combined_mask_mod(lengths.to(device), total_seq_len)
    # read from the library's module at call time: patch.apply installs its CPU version there
    attention_mask = library_core.create_block_mask(mask_mod, B=None, H=None, Q_LEN=total_seq_len,
                                                    KV_LEN=total_seq_len, device=device)
    hidden_states = model.fc(hidden_states)
    run = checkpointed if checkpointing and torch.is_grad_enabled() else called

    return_loss = verifier_last_hidden_states is not None
    if return_loss:
        loss = torch.tensor(0.0, device=device)
        # True where every earlier step was right (the library's; a copy of the mask, in its dtype)
        prev_correct = (loss_mask.clone() if loss_mask is not None
                        else torch.ones(1, total_seq_len, device=device, dtype=torch.bool))
        metrics: dict[str, torch.Tensor] = {}

    past: list[torch.Tensor] = []  # every earlier step's keys and values (see StepCache)
    draft_tokens = []
    dataset_embeds = dataset_embeddings(model, input_ids) if use_off_policy_tokens else None
    for ttt_step in range(ttt_steps):
        cache_position = torch.arange(ttt_step * total_seq_len, (ttt_step + 1) * total_seq_len,
                                      dtype=torch.long, device=device)
        if dataset_embeds is not None:
            input_embeds = shifted(dataset_embeds, ttt_step)
        else:
            with torch.no_grad():
                input_embeds = model.embed_tokens(input_ids)  # frozen
        step = partial(decoder_step, model, attention_mask, layer_kwargs)
        hidden_states, normed, *new_past = run(step, input_embeds, hidden_states, position_ids, cache_position,
                                               *past)
        past += new_past
        if return_loss:
            ids, s_loss, verifier_ids = scored_step(model, draft_loss, run, normed, ttt_step, verifier_last_hidden_states,
                                                    loss_mask, ttt_step_loss_decay)
            s_loss_mask = loss_mask[:, ttt_step:] if loss_mask is not None else None
            s_prev_correct = prev_correct[:, :total_seq_len - ttt_step]  # a view: updated in place, as the library's
            full_acc, cond_acc = accuracy_of(ids[:, :total_seq_len - ttt_step], verifier_ids, s_loss_mask,
                                             s_prev_correct)
            loss += s_loss
            metrics.update({f"loss_{ttt_step}": s_loss.detach().clone(), f"full_acc_{ttt_step}": full_acc,
                            f"cond_acc_{ttt_step}": cond_acc})
        else:
            ids = draft_ids(model, normed)
        draft_tokens.append(ids.detach().clone())
        # fed the draft's tokens: its ids mapped to the verifier's, which the embedding reads (fed the
        # dataset's, the library's teacher forcing, the next step reads `shifted` embeddings instead)
        input_ids = ids + model.d2t[ids]
        attention_mask = extend_mask_for_draft_tokens(attention_mask)
        position_ids = position_ids + 1

    if return_loss:
        metrics["loss"] = loss.detach().clone()
        return draft_tokens, loss, metrics
    return draft_tokens


def checkpointed(function: Callable, *args):
    """`function(*args)` keeping only its inputs for the backward pass, which recomputes it. The
    functions given here draw no random numbers, so the RNG state is not stashed."""
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)


def called(function: Callable, *args):
    """`function(*args)`, every activation kept (checkpointing off, or no gradients)."""
    return function(*args)


# --- one TTT step ---

class StepCache:
    """The key/value cache of one TTT step, in place of the library's DynamicCache shared by all steps:
    made inside the step from the earlier steps' keys/values, it gives each layer's attention
    cat(earlier, new) and records the new ones for the step to return. A recomputed step makes its
    own, so nothing outside it changes. Duck-typed: transformers 4.57's `LlamaAttention` calls only
    `update(key_states, value_states, layer_idx, cache_kwargs)`."""

    def __init__(self, past: Sequence[torch.Tensor], layers: int) -> None:
        # `past`: per earlier step, per layer, its keys then its values (the order decoder_step returns them)
        per_step = [past[i:i + 2 * layers] for i in range(0, len(past), 2 * layers)]
        self.earlier = [([s[2 * i] for s in per_step], [s[2 * i + 1] for s in per_step]) for i in range(layers)]
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.new[layer_idx] = (key_states, value_states)
        keys, values = self.earlier[layer_idx]
        # always a cat, as DynamicCache's first update is too: the same contiguous layout at every step
        return torch.cat([*keys, key_states], dim=-2), torch.cat([*values, value_states], dim=-2)

    def new_states(self) -> list[torch.Tensor]:
        return [t for pair in self.new for t in pair]


@torch.no_grad()
def dataset_embeddings(model: Eagle3DraftModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The embeddings of the dataset's tokens followed by the padding id 0 [1, T + 1, H], read once per
    forward: fed the dataset's tokens, TTT step k reads the same tokens shifted k to the left and
    padded with 0 (`shifted`). One lookup instead of one per step: under torchrun each lookup gathers
    the whole frozen embedding (its own FSDP unit, common/train/distributed.py)."""
    return model.embed_tokens(torch.cat([input_ids, input_ids.new_zeros(1, 1)], dim=-1))


def shifted(embeds: torch.Tensor, ttt_step: int) -> torch.Tensor:
    """The embeddings of the tokens TTT step `ttt_step` reads when fed the dataset's: the library's
    `cat([ids[:, ttt_step:], zeros(1, ttt_step)])` looked up, row for row (a lookup copies rows)."""
    total = embeds.shape[1] - 1
    pad = embeds[:, total:].expand(1, ttt_step, embeds.shape[2])
    return torch.cat([embeds[:, ttt_step:total], pad], dim=1)


def decoder_step(model: Eagle3DraftModel, attention_mask, layer_kwargs: dict, input_embeds: torch.Tensor,
                 hidden_states: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                 *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The body of one TTT step, up to the final norm: (state handed to the next step, normed state,
    this step's keys and values per layer). The step's token embeddings are looked up outside it (the
    embedding is frozen: nothing to recompute, and no second gather of it under FSDP). Modules are
    called, not their weights read, so hooks on them (EAGLE-3.1's, common/draft/eagle31.py) run."""
    hidden_states = torch.cat([input_embeds, hidden_states], dim=-1)
    position_embeddings = model.rotary_emb(hidden_states, position_ids)
    cache = StepCache(past, len(model.layers))
    for decoder_layer in model.layers:
        hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=cache, cache_position=cache_position,
                                      position_embeddings=position_embeddings, **layer_kwargs)
    return hidden_states, model.norm(hidden_states), *cache.new_states()


# --- one TTT step's loss, by tiles ---

def scored_step(model: Eagle3DraftModel, draft_loss: DraftLoss, run: Callable, normed: torch.Tensor, ttt_step: int,
                verifier_last_hidden_states: torch.Tensor, loss_mask: torch.Tensor | None,
                decay: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the draft's argmax at every position [1, T], the step's loss, the verifier's argmax of the
    aligned rows [1, T - ttt_step]). Draft position i is scored against the verifier's row
    i + ttt_step; the last ttt_step positions have no target and give only their argmax."""
    total = normed.shape[1]
    scored = total - ttt_step
    s_loss_mask = loss_mask[:, ttt_step:] if loss_mask is not None else None
    denominator = mean_denominator(s_loss_mask, scored)
    tile = partial(tile_loss, model, draft_loss, decay**ttt_step)
    ids, losses, verifier_ids = [], [], []
    for start in range(0, total, TILE_TOKENS):
        end = min(start + TILE_TOKENS, total)
        rows = max(0, min(end, scored) - start)  # this tile's positions that have a target
        if rows == 0:
            ids.append(draft_ids(model, normed[:, start:end]))
            continue
        rows_mask = s_loss_mask[:, start:start + rows] if s_loss_mask is not None else None
        t_loss, t_ids, t_verifier_ids = run(tile, normed[:, start:end],
                                            verifier_last_hidden_states[:, start + ttt_step:start + ttt_step + rows],
                                            rows_mask, denominator)
        ids.append(t_ids)
        losses.append(t_loss)
        verifier_ids.append(t_verifier_ids)
    if not losses:  # a sequence no longer than the step: no position has a target (the library's 0 / 1e-5)
        return torch.cat(ids, dim=1), normed.new_zeros(()), ids[0].new_zeros(1, 0)
    # one tile is the step's loss itself (no added 0): the library's value and gradient, bit for bit
    return torch.cat(ids, dim=1), sum(losses[1:], losses[0]), torch.cat(verifier_ids, dim=1)


def tile_loss(model: Eagle3DraftModel, draft_loss: DraftLoss, weight: float, normed: torch.Tensor,
              verifier_states: torch.Tensor, loss_mask: torch.Tensor | None,
              denominator: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile: (its share of the step's weighted loss, the draft's argmax of its positions, the
    verifier's argmax of its aligned rows). `verifier_states` holds the rows of the tile's first
    positions that have a target (all of them but at the end of the sequence)."""
    logits = model.lm_head(normed)
    rows = verifier_states.shape[1]
    with torch.no_grad():
        targets = verifier_targets(model.verifier_lm_head(verifier_states), draft_loss.name,
                                   draft_loss.target_temperature)
    loss = weight * step_loss(draft_loss.name, logits[:, :rows], targets, 0, loss_mask, denominator)
    return loss, torch.argmax(logits, dim=-1), targets.ids


@torch.no_grad()
def draft_ids(model: Eagle3DraftModel, normed: torch.Tensor) -> torch.Tensor:
    """The draft's argmax at each position, tile by tile (positions with no loss: validation without
    targets, or the end of a sequence)."""
    return torch.cat([torch.argmax(model.lm_head(normed[:, i:i + TILE_TOKENS]), dim=-1)
                      for i in range(0, normed.shape[1], TILE_TOKENS)], dim=1)
