"""EAGLE-3 speculative decoding: a Hugging Face target verifies what a speculators draft proposes.

One round, as vLLM runs an EAGLE-3 draft with `num_speculative_tokens = k`:

1. The draft proposes a chain of k tokens. Its input at a verified position p is
   `concat(embed(x_p), fc(aux_{p-1}))`, where `aux_{p-1}` are the target's three auxiliary
   states at position p-1 (vLLM layer ids: id i = output of decoder layer i-1). Proposal
   steps 2..k feed the draft's own previous output (the pre-norm hidden state; with EAGLE-3.1's
   `norm_output`, the normed one) in place of `fc(aux)`, one position further each step. Draft ids map to target ids with `d2t`.
2. The target runs once over `[last token, d_1 .. d_k]` with its KV cache. Proposals are
   accepted while each equals the target's greedy choice; the target's own choice after the
   accepted prefix is emitted too (the bonus token), so a round emits 1..k+1 tokens.
3. Both KV caches are cropped to the verified tokens; the draft's context grows by the
   newly verified positions with the auxiliary states the verification pass captured.

The target's auxiliary states come from forward hooks on its decoder layers
(`common.extract.hf_engine.capture_layers`, shared with step 02), never from all N+1 hidden states.

Greedy (temperature 0): the emitted tokens are exactly the target's greedy continuation (what
makes speculative decoding lossless); `plain_generate` at temperature 0 is the plain reference. Sampling
(temperature > 0, top-p): the target accepts each draft token d with probability min(1, p(d)/q(d)),
resampling from normalised max(0, p - q) at the first rejection (`accept_sampled`), so the emitted
tokens follow the target's sampling distribution exactly. How the draft proposes is
`SamplingParams.draft_sampling`, as vLLM's `draft_sample_method`: 'greedy' (vLLM's default) proposes
the draft's argmax and verifies it as a point mass q, accepted with probability p(d);
'probabilistic' samples the chain from the draft's own distribution q. `NgramProposer` (vLLM's `ngram` prompt lookup) is the draft-free baseline;
its proposals are point masses. Acceptance length is reported
as vLLM and SGLang report it: tokens emitted per verification pass (1 + accepted drafts),
the prefill pass not counted, counted before the `max_new_tokens` cut of the last round.

Position convention (the draft's training data, `speculators.train.data.shift_batch`): the
draft's query for token x_p has RoPE position p; its KV cache index c holds position c + 1
(x_0 has no preceding state and is never a draft input).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

__all__ = [
    "aux_states", "DRAFT_SAMPLING", "SamplingParams", "Proposal", "accept_greedy", "accept_sampled", "NgramProposer",
    "ngram_lookup", "DraftProposer", "Generation", "SpeculativeStats", "plain_generate",
    "speculative_generate", "input_device", "longest_run", "distinct_ratio",
]

INFERENCE_ATTENTION = "sdpa"
DRAFT_SAMPLING = ("greedy", "probabilistic")  # vLLM's draft_sample_method values


def input_device(model: torch.nn.Module) -> torch.device:
    """Where input ids must go (the embedding's device; differs from others under device_map auto)."""
    return model.get_input_embeddings().weight.device


def aux_states(captured: dict[int, torch.Tensor], layer_ids: list[int], device: torch.device) -> torch.Tensor:
    """[1, L, 3H]: the auxiliary states the hooks of `common.extract.hf_engine.capture_layers` kept
    from the latest target pass, concatenated in the draft's layer-id order."""
    return torch.cat([captured[i].to(device) for i in layer_ids], dim=-1)


@dataclass(frozen=True)
class SamplingParams:
    """The user's decoding settings: temperature 0 is greedy; otherwise softmax(logits / T)
    restricted to the smallest set of most likely tokens whose mass reaches `top_p`, with the
    draft's proposals made as `draft_sampling` says (one of `DRAFT_SAMPLING`; see the module)."""

    temperature: float = 0.0
    top_p: float = 1.0
    draft_sampling: str = "greedy"

    def __post_init__(self) -> None:
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling {self.draft_sampling!r}: expected one of {', '.join(DRAFT_SAMPLING)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def draft_greedy(self) -> bool:
        """Whether a draft proposes its argmax (always when decoding greedily)."""
        return self.greedy or self.draft_sampling == "greedy"

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] probabilities (float32) under these settings."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p (the most likely one always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return kept / kept.sum(-1, keepdim=True)


@dataclass
class Proposal:
    """Up to k proposed target ids; `probs` [len, V] the distributions they were sampled from, or
    None for a deterministic proposer (greedy draft, n-gram lookup: a point mass on each id)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def accept_greedy(proposal: Proposal, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Greedy verification: proposals accepted while each equals the target's argmax, then the
    target's own choice after them (the bonus token). Returns (accepted, emitted tokens)."""
    choices = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(proposal.tokens) and proposal.tokens[accepted] == choices[accepted]:
        accepted += 1
    return accepted, proposal.tokens[:accepted] + [choices[accepted]]


def accept_sampled(proposal: Proposal, target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, list[int]]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft token d with draft
    probability q(d) is accepted with probability min(1, p(d)/q(d)); at the first rejection the
    token is drawn from normalised max(0, p - q) instead, and after k acceptances a bonus token
    from p. The emitted tokens are distributed exactly as sampling from the target.
    `target_probs` [len+1, V] (CPU) are p at each proposal and after the last one."""
    for j, token in enumerate(proposal.tokens):
        p = target_probs[j]
        q = proposal.probs[j] if proposal.probs is not None else _point_mass(token, p)
        if torch.rand((), generator=generator) * q[token] < p[token]:  # u < p/q without dividing by 0
            continue
        residual = (p - q).clamp_min(0.0)
        total = residual.sum()
        # total is 0 only when p == q, where rejection has probability 0; p is then the right law
        return j, proposal.tokens[:j] + [_sample(residual / total if total > 0 else p, generator)]
    n = len(proposal.tokens)
    return n, proposal.tokens + [_sample(target_probs[n], generator)]


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


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


def _aux(captured: dict[int, torch.Tensor], layer_ids: list[int], device: torch.device,
         length: int | None = None) -> torch.Tensor | None:
    """The first `length` positions of the latest pass's auxiliary states (None: no layers hooked,
    a proposer that reads none)."""
    if not layer_ids:
        return None
    return aux_states(captured, layer_ids, device)[:, :length]


def _choose(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's next token from its last-position logits [V]."""
    if sampling.greedy:
        return int(logits.argmax())
    return _sample(sampling.probs(logits).cpu(), generator)


@torch.no_grad()
def plain_generate(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                   sampling: SamplingParams = SamplingParams(), generator: torch.Generator | None = None) -> Generation:
    """The target alone, one token per forward pass, with KV cache: greedy at temperature 0,
    else sampled (temperature, top-p)."""
    device = input_device(target)
    result = Generation(prompt_len=len(prompt), tokens=[])
    with _timed(result, device):
        ids, cache = torch.tensor([prompt], device=device), None
        while True:
            out = target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            token = _choose(out.logits[0, -1], sampling, generator)
            if _finish(result.tokens, [token], max_new_tokens, stop_ids):
                return result
            ids = torch.tensor([[token]], device=device)


@torch.no_grad()
def speculative_generate(target: torch.nn.Module, captured: dict[int, torch.Tensor], layer_ids: list[int],
                         proposer, prompt: list[int], k: int, max_new_tokens: int, stop_ids: set[int],
                         sampling: SamplingParams = SamplingParams(),
                         generator: torch.Generator | None = None) -> Generation:
    """Speculative decoding of `prompt` (see the module docstring). `captured` is the dict of an
    active `common.extract.hf_engine.capture_layers(layers, layer_ids)`; `proposer` a `DraftProposer`
    or an `NgramProposer`. Greedy at temperature 0 (exactly plain greedy decoding), else the
    speculative-sampling rule (`accept_sampled`)."""
    device = input_device(target)
    result = Generation(prompt_len=len(prompt), tokens=[])
    with _timed(result, device):
        # Prefill: the target's first token, and the proposer's context over positions 1..P.
        out = target(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, _choose(out.logits[0, -1], sampling, generator)
        proposer.start(prompt)
        proposer.extend(torch.tensor(prompt[1:] + [token]), _aux(captured, layer_ids, device))
        done = _finish(result.tokens, [token], max_new_tokens, stop_ids)
        while not done:
            # Verify [last token, d_1..d_m] in one target pass; keep the accepted prefix + one more.
            proposal = proposer.propose(k, sampling, generator)
            verified_len = cache.get_seq_length()
            out = target(input_ids=torch.tensor([[token, *proposal.tokens]], device=device), past_key_values=cache,
                         use_cache=True)
            if sampling.greedy:
                accepted, new = accept_greedy(proposal, out.logits[0])
            else:
                accepted, new = accept_sampled(proposal, sampling.probs(out.logits[0]).cpu(), generator)
            result.accepted.append(accepted)
            cache.crop(verified_len + accepted + 1)
            done = _finish(result.tokens, new, max_new_tokens, stop_ids)
            if not done:
                proposer.extend(torch.tensor(new), _aux(captured, layer_ids, device, accepted + 1))
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


LOOP_RUN = 4  # a generation with a token repeated more than this many times in a row is degenerate


def longest_run(tokens: list[int]) -> int:
    """The longest stretch of one token repeated back to back."""
    best = run = 0
    for i, token in enumerate(tokens):
        run = run + 1 if i and token == tokens[i - 1] else 1
        best = max(best, run)
    return best


def distinct_ratio(tokens: list[int]) -> float:
    """Distinct tokens over tokens (1.0 for an empty generation)."""
    return len(set(tokens)) / len(tokens) if tokens else 1.0
