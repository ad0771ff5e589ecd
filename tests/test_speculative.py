"""common/evaluate/decoding.py's decoding rules on tiny hand-built distributions: speculative sampling
emits the target's distribution (and a deliberately wrong rule is caught by the same test),
top-p, n-gram prompt lookup, and the loop measures 05 reports."""

from __future__ import annotations

import pytest
import torch

from common.evaluate.decoding import (
    NgramProposer,
    Proposal,
    SamplingParams,
    accept_greedy,
    accept_sampled,
    distinct_ratio,
    longest_run,
    ngram_lookup,
)

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


def first_two_tokens(rule, seed: int) -> torch.Tensor:
    """[V, V] counts of the first two tokens emitted after token 0 by speculative decoding of the
    Markov target with the Markov draft (k drafts sampled from the draft's own chain per round)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(SAMPLES):
        emitted: list[int] = []
        last = 0
        while len(emitted) < 2:
            drafts, dists, prev = [], [], last
            for _ in range(K):
                dists.append(DRAFT[prev])
                prev = int(torch.multinomial(DRAFT[prev], 1, generator=g)[0])
                drafts.append(prev)
            target_probs = TARGET[[last, *drafts]]  # p after the last token and after each draft
            _, new = rule(Proposal(drafts, torch.stack(dists)), target_probs, g)
            emitted += new
            last = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts


def chi_square(counts: torch.Tensor) -> float:
    expected = TARGET[0].unsqueeze(1) * TARGET * counts.sum()  # P(a, b) = p(a | 0) p(b | a)
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_emits_the_targets_distribution():
    assert chi_square(first_two_tokens(accept_sampled, seed=0)) < CHI2_CRITICAL


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


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    assert ngram_lookup(tokens, 3, 1, 3) == [4, 5, 1]  # "1 2" last seen before position 9: followed by 4 5 1
    assert ngram_lookup(tokens + [8], 3, 1, 3) == []  # 8 never occurred before
    assert ngram_lookup([3, 4, 3, 4, 3], 2, 2, 3) == [4, 3]  # the longest recurring n wins
    proposer = NgramProposer()
    proposer.start([5, 6, 7])
    proposer.extend(torch.tensor([5, 6]), None)
    assert proposer.propose(K, SamplingParams()).tokens == [7, 5, 6]


def test_loop_measures():
    assert longest_run([1, 2, 2, 2, 3]) == 3
    assert longest_run([]) == 0
    assert distinct_ratio([4, 4, 5, 6]) == 0.75
