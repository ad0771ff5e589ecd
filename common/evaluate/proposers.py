"""The proposers speculative decoding (`common.evaluate.decoding`) verifies: each is given the
verified context (`start` with a prompt, `extend` with verified positions) and proposes up to k
target ids (`propose`, a `Proposal`).

`DraftProposer` runs a speculators EAGLE-3 draft as vLLM runs it. Its input at a verified position
p is `concat(embed(x_p), fc(aux_{p-1}))`, where `aux_{p-1}` are the target's three auxiliary
states at position p-1 (vLLM layer ids: id i = output of decoder layer i-1). Proposal steps
2..k feed the draft's own previous output (the pre-norm hidden state; with EAGLE-3.1's
`norm_output`, the normed one) in place of `fc(aux)`, one position further each step. Draft ids
map to target ids with `d2t`. It proposes its argmax chain, or samples the chain from its own
distribution, as `SamplingParams.draft_sampling` says.

`NgramProposer` (vLLM's `ngram` prompt lookup) is the draft-free baseline; its proposals are
point masses.

Position convention (the draft's training data, `speculators.train.data.shift_batch`): the
draft's query for token x_p has RoPE position p; its KV cache index c holds position c + 1
(x_0 has no preceding state and is never a draft input).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from common.evaluate.decoding import Proposal, SamplingParams

__all__ = ["NgramProposer", "ngram_lookup", "DraftProposer"]

INFERENCE_ATTENTION = "sdpa"


class NgramProposer:
    """Prompt lookup, as vLLM's `ngram` speculative method with `prompt_lookup_min=min_n` and
    `prompt_lookup_max=max_n`: find the earliest occurrence of the context's last n tokens (the
    largest n that recurs) and propose the up to k tokens that followed it; propose nothing when no
    n-gram recurs. A round with nothing proposed is still a target pass that emits one token, and
    counts as one (vLLM's counters skip it, which would flatter the n-gram method: here acceptance
    length stays tokens per target pass)."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []

    def start(self, prompt: list[int]) -> None:
        # `extend` then adds positions 1..P and each verified token, as for the draft
        self.tokens = list(prompt[:1])

    def extend(self, token_ids: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.tokens += [int(t) for t in token_ids]

    def propose(self, k: int, sampling: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
        return Proposal(ngram_lookup(self.tokens, k, self.min_n, self.max_n))


def ngram_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the last n tokens, for the largest n
    in [min_n, max_n] that recurs; [] when none does. vLLM's choice (`ngram_proposer.py`): the
    longest match, and of those the earliest in the context."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


class DraftProposer:
    """An `Eagle3DraftModel` run for inference: its own KV cache over the verified context,
    and chains of proposals that are dropped from the cache once verified."""

    def __init__(self, draft: torch.nn.Module):
        self.draft = draft.eval()
        self.layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
        self.target_vocab = int(draft.t2d.numel())
        self.layer_config = draft.layers[0].self_attn.config  # shared by all of the draft's layers
        self.dtype = draft.fc.weight.dtype
        self.device = draft.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.context_len = 0  # cache entries holding verified positions 1..context_len
        self.last_hidden: torch.Tensor | None = None  # state handed on from the last verified position
        self.last_logits: torch.Tensor | None = None  # draft-vocabulary logits predicted after it

    def start(self, prompt: list[int]) -> None:
        """A new prompt (the draft builds its context from the prefill pass, in `extend`)."""
        self.reset()

    @torch.no_grad()
    def extend(self, token_ids: torch.Tensor, aux: torch.Tensor) -> None:
        """Add verified positions: `token_ids` [L] (x_p ...) with `aux` [1, L, 3H] (the target's
        auxiliary states at p-1 ...)."""
        hidden = self.draft.fc(aux.to(self.device, self.dtype))
        self.last_hidden, self.last_logits = self._step(token_ids.to(self.device), hidden)
        self.context_len += token_ids.shape[0]

    @torch.no_grad()
    def propose(self, k: int, sampling: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
        """k target ids: the prediction after the context, then k-1 steps on the draft's own states;
        the draft's argmax (`sampling.draft_greedy`), else sampled from the draft's distribution
        (kept, over target ids, for the acceptance rule)."""
        hidden, logits = self.last_hidden, self.last_logits
        tokens, dists = [], []
        for step in range(k):
            if sampling.draft_greedy:
                draft_id = logits.argmax()
            else:
                probs = sampling.probs(logits.float()).cpu()
                draft_id = torch.multinomial(probs, 1, generator=generator)[0].to(logits.device)
                dists.append(probs)
            token = draft_id + self.draft.d2t[draft_id]
            tokens.append(int(token))
            if step < k - 1:
                hidden, logits = self._step(token.view(1), hidden)
        self.cache.crop(self.context_len)  # the chain is not context: verification decides what is
        if sampling.draft_greedy:
            return Proposal(tokens)
        return Proposal(tokens, self._to_target_vocab(torch.stack(dists)))

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """[k, draft vocab] -> [k, target vocab]: each draft id's mass at its target id."""
        ids = torch.arange(probs.shape[1]) + self.draft.d2t.cpu()
        out = torch.zeros(probs.shape[0], self.target_vocab)
        out[:, ids] = probs
        return out

    def _step(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft's layers over L new positions; return (the state handed to the next step
        [1, 1, H] at the last one: pre-norm, or normed with EAGLE-3.1's `norm_output`, whose hooks
        see to it, common/draft/eagle31.py; the draft-vocabulary logits predicted there)."""
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
        return last, draft.lm_head(draft.norm(last))[0, -1]
