"""common/evaluate/decoding.py: greedy speculative decoding (lossless on both miniature targets with
a random draft, an oracle and prompt lookup, the target's states captured at the right positions,
stops at the end of a turn), acceptance statistics, and the decoding rules on tiny hand-built
distributions: speculative sampling emits the target's distribution (and a deliberately wrong rule
is caught by the same test), top-p, and the loop measures 05 reports."""

from __future__ import annotations

import random

import pytest
import torch

from common.draft.validation import simulated_acceptance_length
from common.evaluate.decoding import (
    Generation,
    Proposal,
    SamplingParams,
    SpeculativeStats,
    accept_greedy,
    accept_sampled,
    distinct_ratio,
    longest_run,
    plain_generate,
    speculative_generate,
)
from common.evaluate.proposers import DraftProposer, NgramProposer
from common.extract.hf_engine import capture_layers
from common.target.int4_experts import PackedLinear
from common.target.model import decoder_parts

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, K, SAMPLES = 6, 3, 20_000
CHI2_CRITICAL = 66.62  # chi-square, 35 degrees of freedom (6 x 6 cells - 1), p = 0.001


def _markov(seed: int, sharpness: float) -> torch.Tensor:
    """[V, V] next-token distributions given the previous token: a small-vocabulary LM."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * sharpness
    return torch.softmax(logits, dim=-1)


TARGET = _markov(0, 1.5)
DRAFT = _markov(1, 1.5)  # a draft that disagrees with the target often


def resample_from_target(proposal: Proposal, target_probs: torch.Tensor, generator) -> tuple[int, list[int]]:
    """A plausible but wrong rule: accept w.p. min(1, p/q), and on rejection draw from p itself
    instead of the residual max(0, p - q). It over-weights tokens the draft likes."""
    for j, token in enumerate(proposal.tokens):
        p, q = target_probs[j], proposal.probs[j]
        if torch.rand((), generator=generator) * q[token] >= p[token]:
            return j, proposal.tokens[:j] + [int(torch.multinomial(p, 1, generator=generator)[0])]
    n = len(proposal.tokens)
    return n, proposal.tokens + [int(torch.multinomial(target_probs[n], 1, generator=generator)[0])]


def first_two_tokens(rule, seed: int, greedy_draft: bool = False) -> torch.Tensor:
    """[V, V] counts of the first two tokens emitted after token 0 by speculative decoding of the
    Markov target with the Markov draft (k drafts per round sampled from the draft's own chain, or
    its argmax chain with `greedy_draft`, verified as point masses as vLLM does by default)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(SAMPLES):
        emitted: list[int] = []
        last = 0
        while len(emitted) < 2:
            drafts, dists, prev = [], [], last
            for _ in range(K):
                dists.append(DRAFT[prev])
                prev = int(DRAFT[prev].argmax() if greedy_draft else torch.multinomial(DRAFT[prev], 1, generator=g)[0])
                drafts.append(prev)
            target_probs = TARGET[[last, *drafts]]  # p after the last token and after each draft
            _, new = rule(Proposal(drafts, None if greedy_draft else torch.stack(dists)), target_probs, g)
            emitted += new
            last = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts


def chi_square(counts: torch.Tensor) -> float:
    expected = TARGET[0].unsqueeze(1) * TARGET * counts.sum()  # P(a, b) = p(a | 0) p(b | a)
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_emits_the_targets_distribution():
    assert chi_square(first_two_tokens(accept_sampled, seed=0)) < CHI2_CRITICAL


def test_greedy_drafts_verified_as_point_masses_emit_the_targets_distribution():
    """vLLM's default at a temperature (draft_sample_method 'greedy'): the draft's argmax, accepted
    with probability p(d), the residual p without d on rejection: still the target's law."""
    assert chi_square(first_two_tokens(accept_sampled, seed=0, greedy_draft=True)) < CHI2_CRITICAL


def test_the_same_check_rejects_a_wrong_rule():
    assert chi_square(first_two_tokens(resample_from_target, seed=0)) > 3 * CHI2_CRITICAL


def test_acceptance_counts_and_bonus():
    p = torch.eye(VOCAB)[[1, 2, 3, 4]]  # the target is certain: 1, then 2, 3, 4
    proposal = Proposal([1, 2, 5], torch.full((3, VOCAB), 1 / VOCAB))
    assert accept_sampled(proposal, p, torch.Generator().manual_seed(0)) == (2, [1, 2, 3])
    assert accept_sampled(Proposal([1, 2, 3]), p, None) == (3, [1, 2, 3, 4])  # point-mass proposals
    assert accept_sampled(Proposal([]), p[:1], None) == (0, [1])  # nothing proposed: one target token
    assert accept_greedy(Proposal([1, 5, 3]), torch.log(p + 1e-9)) == (1, [1, 2])


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert SamplingParams(1.0, 0.7).probs(logits).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert SamplingParams(1.0, 0.1).probs(logits).tolist() == pytest.approx([1, 0, 0, 0])
    assert SamplingParams(1.0).probs(logits).tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert SamplingParams(0.5).probs(logits)[0] > 0.5  # a lower temperature sharpens


def test_loop_measures():
    assert longest_run([1, 2, 2, 2, 3]) == 3
    assert longest_run([]) == 0
    assert distinct_ratio([4, 4, 5, 6]) == 0.75


# --- speculative decoding on the miniature targets ------------------------------------------


def some_prompts(info, count: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 4096) for _ in range(length)] for _ in range(count)]



# --- lossless ----------------------------------------------------------------------------------


class OracleProposer:
    """Proposes the target's known greedy continuation with its n-th proposal wrong from token
    (n + seed) mod (k + 1) on (none wrong at k), so every count of accepted drafts (0..k) occurs
    whatever the target writes (random corruptions missed a count on a target whose answers
    stopped early); records the auxiliary states it is given."""

    device = torch.device("cpu")

    def __init__(self, prompt: list[int], continuation: list[int], seed: int):
        self.sequence = prompt + continuation
        self.proposals = seed
        self.reset()

    def start(self, prompt: list[int]) -> None:
        self.reset()

    def reset(self) -> None:
        self.position = 1  # next index of `sequence` the draft gets as verified context (x_0 never)
        self.aux: list[torch.Tensor] = []

    def extend(self, token_ids: torch.Tensor, aux: torch.Tensor) -> None:
        assert aux.shape[:2] == (1, token_ids.shape[0])
        assert token_ids.tolist() == self.sequence[self.position:self.position + token_ids.shape[0]]
        self.position += token_ids.shape[0]
        self.aux.append(aux)

    def propose(self, k: int, sampling: SamplingParams, generator=None) -> Proposal:
        truth = (self.sequence[self.position:] + [0] * k)[:k]
        right = self.proposals % (k + 1)
        self.proposals += 1
        return Proposal([t if i < right else (t + 1) % 4096 for i, t in enumerate(truth)])


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_speculative_decoding_is_lossless(models, name):
    """Same tokens as plain greedy decoding (and as transformers' generate) with a random draft,
    with an oracle draft that gets 0..k tokens accepted and with prompt lookup; the states handed to
    the draft are the target's own states at the verified positions, prompt lookup's context the
    prompt and the verified tokens."""
    model, info, draft = models[name]
    assert (name == "kimi") == any(isinstance(m, PackedLinear) for m in model.modules())  # INT4 experts, as Kimi-K2.5
    stop_ids = info.stop_ids
    layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
    _, layers = decoder_parts(model)
    accepted_counts = set()
    for seed, prompt in enumerate(some_prompts(info, 3)):
        greedy = plain_generate(model, prompt, 24, stop_ids)
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=sorted(stop_ids), pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy.tokens == reference
        oracle = OracleProposer(prompt, greedy.tokens, seed)
        with capture_layers(layers, layer_ids) as captured:
            random_run = speculative_generate(model, captured, layer_ids, DraftProposer(draft), prompt, K, 24, stop_ids)
            oracle_run = speculative_generate(model, captured, layer_ids, oracle, prompt, K, 24, stop_ids)
        ngram = NgramProposer()
        ngram_run = speculative_generate(model, {}, [], ngram, prompt, K, 24, stop_ids)
        assert random_run.tokens == greedy.tokens
        assert oracle_run.tokens == greedy.tokens
        assert ngram_run.tokens == greedy.tokens
        # prompt lookup searches the prompt once and what followed it, up to the last verified token
        assert prompt + greedy.tokens[:len(ngram.tokens) - len(prompt)] == ngram.tokens
        assert len(ngram.tokens) > len(prompt)
        accepted_counts.update(oracle_run.accepted)
        # every pass emits accepted + 1 tokens; the last pass may be cut at max_new_tokens
        assert sum(a + 1 for a in oracle_run.accepted) + 1 >= len(greedy.tokens)
        assert oracle_run.target_passes < len(greedy.tokens)  # fewer passes than plain greedy decoding

        seen = torch.cat(oracle.aux, dim=1)[0]
        full = model(torch.tensor([prompt + greedy.tokens]), output_hidden_states=True).hidden_states
        expected = torch.cat([full[i][0] for i in layer_ids], dim=-1)[:seen.shape[0]]
        torch.testing.assert_close(seen, expected, atol=1e-4, rtol=1e-4)
    assert accepted_counts == set(range(K + 1))


def test_stops_at_end_of_turn(models):
    model, info, draft = models["kimi"]
    prompt = some_prompts(info, 1)[0]
    first = plain_generate(model, prompt, 8, set()).tokens
    stop = {first[4]}
    cut = plain_generate(model, prompt, 8, stop).tokens
    assert cut == first[:first.index(first[4]) + 1]
    layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
    with capture_layers(decoder_parts(model)[1], layer_ids) as captured:
        spec = speculative_generate(model, captured, layer_ids, DraftProposer(draft), prompt, K, 8, stop)
    assert spec.tokens == cut



def test_acceptance_statistics():
    stats = SpeculativeStats(3)
    stats.add(Generation(prompt_len=5, tokens=[1] * 9, accepted=[3, 0, 1]))
    stats.add(Generation(prompt_len=5, tokens=[1] * 4, accepted=[2]))
    assert stats.passes == 4
    assert stats.acceptance_length == pytest.approx(1 + 6 / 4)
    assert stats.acceptance_rate_per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    # with independent per-position rates the simulated formula gives the same expectation
    assert simulated_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)

