"""common/evaluate/proposers.py: the draft run at inference exactly as it was trained (its chain
after every prefix equals the training forward), its argmax or sampled proposals, and n-gram prompt
lookup (the earliest longest match, as vLLM's own ngram proposer)."""

from __future__ import annotations

import json
import random
import subprocess

import pytest
import torch

from common.draft import patch
from common.evaluate.decoding import SamplingParams
from common.evaluate.proposers import DraftProposer, NgramProposer, ngram_lookup

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams()
K = 3

VLLM_NGRAM = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose
cases = json.load(sys.stdin)
print(json.dumps([propose(np.array(t, dtype=np.int32), lo, hi, 10**6, k).tolist() for t, lo, hi, k in cases]))
"""


def test_the_draft_proposes_its_argmax_unless_sampling_probabilistically(models):
    """At a temperature a draft proposes its greedy chain with no distribution (point masses), as at
    temperature 0; 'probabilistic' samples its chain and keeps q over the target's vocabulary."""
    _, _, draft = models["kimi"]
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 4096, (8,)), torch.randn(1, 8, 3 * draft.hidden_size)
    proposer = DraftProposer(draft)
    proposer.extend(ids, aux)
    greedy = proposer.propose(K, GREEDY)
    at_one = proposer.propose(K, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert SamplingParams(1.0).draft_greedy and at_one.tokens == greedy.tokens and at_one.probs is None
    sampled = proposer.propose(K, SamplingParams(1.0, draft_sampling="probabilistic"), torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (K, 163840) and sampled.probs.sum(-1).tolist() == pytest.approx([1.0] * K)
    assert all(sampled.probs[j, t] > 0 for j, t in enumerate(sampled.tokens))
    with pytest.raises(ValueError, match="draft_sampling 'beam'"):
        SamplingParams(1.0, draft_sampling="beam")


def test_ngram_lookup_proposes_what_followed_the_earliest_longest_match():
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    assert ngram_lookup(tokens, 3, 1, 3) == [3, 9, 1]  # "1 2" first seen at position 1: followed by 3 9 1
    assert ngram_lookup(tokens + [8], 3, 1, 3) == []  # 8 never occurred before
    assert ngram_lookup([3, 4, 3, 4, 3], 2, 2, 3) == [4, 3]  # the longest recurring n wins
    # fed as speculative_generate feeds a proposer: the prompt, then positions 1..P and the first
    # token, then each pass's verified tokens; the context is the prompt once, then what followed
    proposer = NgramProposer()
    proposer.start([5, 6, 7])
    proposer.extend(torch.tensor([6, 7, 5]), None)
    assert proposer.tokens == [5, 6, 7, 5]
    assert proposer.propose(K, SamplingParams()).tokens == [6, 7, 5]
    proposer.extend(torch.tensor([6]), None)
    assert proposer.propose(K, SamplingParams()).tokens == [7, 5, 6]


def test_ngram_lookup_proposes_what_vllms_ngram_proposer_does(vllm_python):
    """Against vLLM's own proposer function, on contexts where n-grams recur at several lengths and
    positions (a 4-token alphabet), for several n ranges and k."""
    rng = random.Random(0)
    cases = [([rng.randrange(4) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 4), rng.randrange(3, 6),
              rng.randrange(1, 6)) for _ in range(300)]
    probe = subprocess.run([str(vllm_python), "-c", VLLM_NGRAM], input=json.dumps(cases), capture_output=True,
                           text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    theirs = json.loads(probe.stdout.splitlines()[-1])
    ours = [ngram_lookup(tokens, k, min_n, max_n) for tokens, min_n, max_n, k in cases]
    assert ours == theirs
    assert sum(map(bool, ours)) > 150  # over half the contexts propose something


# --- the draft runs at inference exactly as it was trained ------------------------------------


def test_draft_chain_equals_the_training_forward(models):
    """The proposer's chain after every prefix equals the library's training forward, whose TTT
    step j at position i is the draft's j+1-th proposal after token i+1 (same masks, positions,
    d2t mapping). The proposer extends its cache in two chunks to exercise it."""
    _, _, draft = models["kimi"]
    torch.manual_seed(1)
    seq, hidden = 20, draft.hidden_size
    ids = torch.randint(0, 4096, (seq,))
    aux = torch.randn(1, seq, 3 * hidden)
    with torch.no_grad():
        steps = draft(hidden_states=aux[:, :-1], input_ids=ids[1:].unsqueeze(0), ttt_steps=K)
    expected = torch.stack([s[0] + draft.d2t[s[0]] for s in steps], dim=-1)  # [seq-1, K] target ids
    proposer = DraftProposer(draft)
    for i in range(seq - 1):
        proposer.reset()
        cut = max(1, (i + 1) // 2)
        proposer.extend(ids[1:1 + cut], aux[:, :cut])
        proposer.propose(K, GREEDY)  # a chain that verification would drop
        if i + 1 > cut:
            proposer.extend(ids[1 + cut:i + 2], aux[:, cut:i + 1])
        assert proposer.propose(K, GREEDY).tokens == expected[i].tolist(), f"prefix of {i + 2} tokens"
    assert draft.layers[0].self_attn.config._attn_implementation == patch.ATTENTION_NAME  # restored
