"""common/evaluate/served.py without an engine: where a served output first differs from plain
vLLM's, the target's top-2 logit gap there and bf16's step at that logit (a near-tie or not), and
the figures --json carries. The engine runs are in tests/test_vllm.py."""

from __future__ import annotations

import math

import pytest
import torch

from common.evaluate.prompts import Prompt
from common.evaluate.served import VllmMeasured, explain_divergences

pytestmark = pytest.mark.usefixtures("one_thread")


def test_divergence_gives_the_first_differing_token_and_the_top2_gap(models):
    model, info, _ = models["flat"]
    prompt = Prompt(0, "p0", [1, 2630, 203, 2418, 262, 1021])
    with torch.no_grad():
        plain, ids = [], list(prompt.ids)
        for _ in range(6):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            plain.append(token)
            ids.append(token)
        logits = model(torch.tensor([prompt.ids + plain[:3]])).logits[0, -1]
    best, second = logits.topk(2).values.tolist()
    runner_up = int(logits.topk(2).indices[1])
    other = plain[:3] + [runner_up, 7, 7]  # a served run that took the second-best token at position 3
    plain_run = VllmMeasured([plain, plain], seconds=1.0)
    served = {"draft": {3: VllmMeasured([plain, other], seconds=1.0, mismatched=["p1"])}}
    explain_divergences(model, [Prompt(0, "p0", prompt.ids), Prompt(1, "p1", prompt.ids)], plain_run, served)
    (d,) = served["draft"][3].divergences
    assert (d.sample_id, d.position, d.plain_token, d.draft_token) == ("p1", 3, plain[3], runner_up)
    assert d.top2_gap == pytest.approx(best - second, abs=1e-5)
    assert d.bf16_step == 2.0 ** (math.floor(math.log2(abs(best))) - 7)
    assert d.near_tie == (best - second < d.bf16_step)
    figures = served["draft"][3].figures()
    assert figures["differing_share"] == 0.5 and figures["identical_to_greedy"] is False
    assert figures["divergences"] == [d.figures()] and figures["divergences"][0]["position"] == 3


def test_an_output_that_stops_early_differs_where_it_ends(models):
    model, _, _ = models["flat"]
    plain_run = VllmMeasured([[5, 6, 7]], seconds=1.0)
    served = {"draft": {1: VllmMeasured([[5, 6]], seconds=1.0, mismatched=["p0"])}}
    explain_divergences(model, [Prompt(0, "p0", [1, 2630, 203])], plain_run, served)
    (d,) = served["draft"][1].divergences
    assert (d.position, d.plain_token, d.draft_token) == (2, 7, -1)
