"""Greedy EAGLE-3 speculative decoding: a Hugging Face target verifies what a speculators draft proposes.

One round, as vLLM runs an EAGLE-3 draft with `num_speculative_tokens = k`:

1. The draft proposes a chain of k tokens. Its input at a verified position p is
   `concat(embed(x_p), fc(aux_{p-1}))`, where `aux_{p-1}` are the target's three auxiliary
   states at position p-1 (vLLM layer ids: id i = output of decoder layer i-1). Proposal
   steps 2..k feed the draft's own previous output (the pre-norm hidden state) in place of
   `fc(aux)`, one position further each step. Draft ids map to target ids with `d2t`.
2. The target runs once over `[last token, d_1 .. d_k]` with its KV cache. Proposals are
   accepted while each equals the target's greedy choice; the target's own choice after the
   accepted prefix is emitted too (the bonus token), so a round emits 1..k+1 tokens.
3. Both KV caches are cropped to the verified tokens; the draft's context grows by the
   newly verified positions with the auxiliary states the verification pass captured.

The target's auxiliary states come from forward hooks on its decoder layers
(`common.hidden_states.capture_layers`, shared with step 02), never from all N+1 hidden states.

The emitted tokens are exactly the target's greedy continuation (what makes speculative
decoding lossless); `greedy_generate` is the plain reference. Acceptance length is reported
as vLLM and SGLang report it: tokens emitted per verification pass (1 + accepted drafts),
the prefill pass not counted, counted before the `max_new_tokens` cut of the last round.

Position convention (the draft's training data, `speculators.train.data.shift_batch`): the
draft's query for token x_p has RoPE position p; its KV cache index c holds position c + 1
(x_0 has no preceding state and is never a draft input).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from transformers import DynamicCache, GenerationConfig

__all__ = [
    "aux_states", "DraftProposer", "Generation", "SpeculativeStats", "greedy_generate",
    "speculative_generate", "stop_token_ids", "input_device",
]

INFERENCE_ATTENTION = "sdpa"


def input_device(model: torch.nn.Module) -> torch.device:
    """Where input ids must go (the embedding's device; differs from others under device_map auto)."""
    return model.get_input_embeddings().weight.device


def stop_token_ids(target_path: str | Path, text_config) -> set[int]:
    """End-of-sequence ids of a target: its text config's eos plus generation_config.json's (Kimi-K2.5
    ends a turn with `<|im_end|>`, which only the generation config names)."""
    ids: set[int] = set()

    def add(value) -> None:
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)

    add(getattr(text_config, "eos_token_id", None))
    if (Path(target_path) / "generation_config.json").is_file():
        add(GenerationConfig.from_pretrained(target_path).eos_token_id)
    return ids


def aux_states(captured: dict[int, torch.Tensor], layer_ids: list[int], device: torch.device) -> torch.Tensor:
    """[1, L, 3H]: the auxiliary states the hooks of `common.hidden_states.capture_layers` kept
    from the latest target pass, concatenated in the draft's layer-id order."""
    return torch.cat([captured[i].to(device) for i in layer_ids], dim=-1)


class DraftProposer:
    """An `Eagle3DraftModel` run for inference: its own KV cache over the verified context,
    and chains of proposals that are dropped from the cache once verified."""

    def __init__(self, draft: torch.nn.Module):
        self.draft = draft.eval()
        self.layer_config = draft.layers[0].self_attn.config  # shared by all of the draft's layers
        self.dtype = draft.fc.weight.dtype
        self.device = draft.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.context_len = 0  # cache entries holding verified positions 1..context_len
        self.last_hidden: torch.Tensor | None = None  # pre-norm output at the last verified position
        self.last_token: torch.Tensor | None = None  # target id the draft predicts after it

    @torch.no_grad()
    def extend(self, token_ids: torch.Tensor, aux: torch.Tensor) -> None:
        """Add verified positions: `token_ids` [L] (x_p ...) with `aux` [1, L, 3H] (the target's
        auxiliary states at p-1 ...)."""
        hidden = self.draft.fc(aux.to(self.device, self.dtype))
        self.last_hidden, self.last_token = self._step(token_ids.to(self.device), hidden)
        self.context_len += token_ids.shape[0]

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        """k target ids: the prediction after the context, then k-1 steps on the draft's own states."""
        hidden, token = self.last_hidden, self.last_token
        proposals = [token]
        for _ in range(k - 1):
            hidden, token = self._step(token.view(1), hidden)
            proposals.append(token)
        self.cache.crop(self.context_len)  # the chain is not context: verification decides what is
        return [int(t) for t in proposals]

    def _step(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft's layers over L new positions; return (pre-norm state [1, 1, H] at the
        last one, the target id predicted there)."""
        draft, length = self.draft, token_ids.shape[0]
        past = self.cache.get_seq_length()
        x = torch.cat([draft.embed_tokens(token_ids).unsqueeze(0).to(self.dtype), hidden], dim=-1)
        cache_position = torch.arange(past, past + length, device=self.device)
        position_ids = (cache_position + 1).unsqueeze(0)
        position_embeddings = draft.rotary_emb(x, position_ids)
        mask = None
        if length > 1:  # causal over cache + new positions (SDPA's is_causal assumes no cache)
            keys = torch.arange(past + length, device=self.device)
            mask = (keys.unsqueeze(0) <= cache_position.unsqueeze(1)).view(1, 1, length, past + length)
        # The layers are configured for training attention (a FlexAttention block mask); this
        # pass gives them a plain boolean mask, so it runs them with SDPA, and then restores.
        training_attention = self.layer_config._attn_implementation
        self.layer_config._attn_implementation = INFERENCE_ATTENTION
        try:
            for layer in draft.layers:
                x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=self.cache,
                          cache_position=cache_position, position_embeddings=position_embeddings)
        finally:
            self.layer_config._attn_implementation = training_attention
        last = x[:, -1:]
        draft_id = draft.lm_head(draft.norm(last))[0, -1].argmax()
        return last, draft_id + draft.d2t[draft_id]


@dataclass
class Generation:
    """One prompt's continuation and how it was produced."""

    prompt_len: int
    tokens: list[int]
    seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verification pass

    @property
    def target_passes(self) -> int:
        return len(self.accepted)


@contextmanager
def _timed(result: Generation, device: torch.device) -> Iterator[None]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    yield
    sync()
    result.seconds = time.perf_counter() - start


def _finish(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Append `new` to `tokens` up to the budget or a stop token; True when generation is over."""
    for token in new:
        tokens.append(token)
        if token in stop_ids or len(tokens) >= max_new_tokens:
            return True
    return False


@torch.no_grad()
def greedy_generate(target: torch.nn.Module, prompt: list[int], max_new_tokens: int,
                    stop_ids: set[int]) -> Generation:
    """Plain greedy decoding of the target alone, one token per forward pass, with KV cache."""
    device = input_device(target)
    result = Generation(prompt_len=len(prompt), tokens=[])
    with _timed(result, device):
        ids, cache = torch.tensor([prompt], device=device), None
        while True:
            out = target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            if _finish(result.tokens, [token], max_new_tokens, stop_ids):
                return result
            ids = torch.tensor([[token]], device=device)


@torch.no_grad()
def speculative_generate(target: torch.nn.Module, captured: dict[int, torch.Tensor], layer_ids: list[int],
                         proposer: DraftProposer, prompt: list[int], k: int, max_new_tokens: int,
                         stop_ids: set[int]) -> Generation:
    """Greedy speculative decoding of `prompt` (see the module docstring). `captured` is the dict
    of an active `common.hidden_states.capture_layers(layers, layer_ids)`."""
    device = input_device(target)
    result = Generation(prompt_len=len(prompt), tokens=[])
    with _timed(result, device):
        # Prefill: the target's first token, and the draft's context over positions 1..P.
        out = target(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        proposer.reset()
        proposer.extend(torch.tensor(prompt[1:] + [token]), aux_states(captured, layer_ids, proposer.device))
        done = _finish(result.tokens, [token], max_new_tokens, stop_ids)
        while not done:
            # Verify [last token, d_1..d_k] in one target pass; keep the agreeing prefix + bonus.
            drafts = proposer.propose(k)
            verified_len = cache.get_seq_length()
            out = target(input_ids=torch.tensor([[token, *drafts]], device=device), past_key_values=cache,
                         use_cache=True)
            choices = out.logits[0].argmax(-1).tolist()
            accepted = 0
            while accepted < k and drafts[accepted] == choices[accepted]:
                accepted += 1
            new = drafts[:accepted] + [choices[accepted]]
            result.accepted.append(accepted)
            cache.crop(verified_len + accepted + 1)
            done = _finish(result.tokens, new, max_new_tokens, stop_ids)
            if not done:
                proposer.extend(torch.tensor(new), aux_states(captured, layer_ids, proposer.device)[:, :accepted + 1])
                token = new[-1]
    return result


@dataclass
class SpeculativeStats:
    """Acceptance over many generations, as vLLM's spec-decode metrics define it."""

    k: int
    passes: int = 0  # verification passes of the target
    accepted_total: int = 0
    accepted_at: list[int] = field(default_factory=list)  # passes whose draft j (0-based) was accepted

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.k

    def add(self, generation: Generation) -> None:
        for accepted in generation.accepted:
            self.passes += 1
            self.accepted_total += accepted
            for j in range(accepted):
                self.accepted_at[j] += 1

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification pass: 1 + mean accepted drafts."""
        return 1.0 + self.accepted_total / self.passes if self.passes else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.passes if self.passes else float("nan") for n in self.accepted_at]
