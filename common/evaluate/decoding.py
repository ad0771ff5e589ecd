"""EAGLE-3 speculative decoding: a Hugging Face target verifies what a proposer
(`common.evaluate.proposers`: a speculators draft, or n-gram prompt lookup) proposes. The decoding
loops, the acceptance rules, and the statistics of what they generate.

One round, as vLLM runs an EAGLE-3 draft with `num_speculative_tokens = k`:

1. The proposer proposes a chain of k tokens (the draft from the target's auxiliary states at
   the verified positions, see `common.evaluate.proposers`).
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
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = [
    "aux_states", "DRAFT_SAMPLING", "SamplingParams", "Proposal", "accept_greedy", "accept_sampled", "Generation",
    "SpeculativeStats", "plain_generate", "speculative_generate", "input_device", "longest_run", "distinct_ratio",
]

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
    or an `NgramProposer` (`common.evaluate.proposers`). Greedy at temperature 0 (exactly plain greedy decoding), else the
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
