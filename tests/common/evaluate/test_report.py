"""common/evaluate/report.py: the side-by-side table (one column per draft, and per k when there are
several), the gap note, figures per prompt set and category counted right, --json's keys
(the contract's top level at the first k, `by_prompt_set`, `by_k`), and the same figures as the
trackers' scalars at each k."""

from __future__ import annotations

import json

import pytest

from common.evaluate.decoding import Generation, SpeculativeStats
from common.evaluate.measure import MeasuredResult
from common.evaluate.prompts import Prompt
from common.evaluate.report import (
    DraftReport,
    by_prompt_set,
    gap_notes,
    served_scalars,
    summary_table,
    tracker_scalars,
    write_report,
)
from common.evaluate.served import VllmMeasured

K = 3
OFFLINE = {"simulated_acceptance_length": 1.5, "val_loss": 2.0, "loss_per_step": [1.0, 0.6, 0.4],
           "full_acc": [0.4, 0.1, 0.0], "cond_acc": [0.4, 0.25, 0.0]}


def test_side_by_side_table():
    table = summary_table([DraftReport("draft", "a", offline=OFFLINE),
                           DraftReport("reference", "b", offline={**OFFLINE, "val_loss": 3.0})], K)
    lines = table.splitlines()
    assert lines[0].split() == ["draft", "reference"]
    assert any(line.split()[-2:] == ["2.000", "3.000"] for line in lines if line.startswith("validation loss"))
    assert sum("cond. accuracy" in line for line in lines) == K


def test_gap_between_measured_and_simulated_is_explained():
    stats = SpeculativeStats(K)
    stats.add(Generation(prompt_len=3, tokens=[1] * 5, accepted=[0, 0, 1]))  # measured 1.333
    close = DraftReport("close", "a", {K: MeasuredResult(K, stats, [])}, {"simulated_acceptance_length": 1.4})
    far = DraftReport("far", "b", {K: MeasuredResult(K, stats, [])}, {"simulated_acceptance_length": 1.8})
    notes = gap_notes([close, far])
    assert len(notes) == 1 and notes[0].startswith("note: far measures 1.333 but simulates 1.800")


# Two MT-Bench questions (two turns each, categories writing and math) and one HumanEval problem.
PROMPTS = [Prompt(0, "mt:81:1", [1], "mt-bench", "writing", 1), Prompt(1, "mt:81:2", [1], "mt-bench", "writing", 2),
           Prompt(2, "mt:111:1", [1], "mt-bench", "math", 1), Prompt(3, "mt:111:2", [1], "mt-bench", "math", 2),
           Prompt(4, "he:0", [1], "humaneval", None, 1)]
ACCEPTED = [[3, 3], [1], [0, 0, 2], [0], [2, 1]]


def measured(k: int, accepted: list[list[int]]) -> MeasuredResult:
    generations = [Generation(1, [5] * (sum(a) + len(a) + 1), accepted=a) for a in accepted]
    stats = SpeculativeStats(k)
    for g in generations:
        stats.add(g)
    return MeasuredResult(k, stats, generations)


def test_figures_per_prompt_set_and_category():
    sets = by_prompt_set(PROMPTS, measured(K, ACCEPTED).generations, K)
    assert list(sets) == ["mt-bench", "humaneval"]
    mt = sets["mt-bench"]
    assert mt["generations"] == 4
    assert mt["measured_acceptance_length"] == pytest.approx(1 + 9 / 7)  # 9 accepted over 7 passes
    assert mt["acceptance_rate_per_position"] == pytest.approx([4 / 7, 3 / 7, 2 / 7])
    assert mt["by_category"] == {"writing": {"measured_acceptance_length": pytest.approx(1 + 7 / 3), "generations": 2},
                                 "math": {"measured_acceptance_length": pytest.approx(1 + 2 / 4), "generations": 2}}
    assert sets["humaneval"] == {"measured_acceptance_length": 2.5, "generations": 1,
                                 "acceptance_rate_per_position": [1.0, 0.5, 0.0], "by_category": {}}


def test_several_k_in_the_table_and_the_json(tmp_path):
    draft = DraftReport("draft", "d", {3: measured(3, ACCEPTED), 5: measured(5, [[5], [1], [0, 4], [0], [2]])},
                        offline=OFFLINE)
    table = summary_table([draft], [3, 5], prompts=PROMPTS).splitlines()
    assert table[0].split() == ["draft", "k=3", "draft", "k=5"]
    assert any(line.split()[:4] == ["acceptance", "length,", "mt-bench", "(4"] for line in table)
    assert any(line.split()[:2] == ["math", "(2)"] for line in table)
    assert sum("acceptance rate, draft" in line for line in table) == 5
    out = tmp_path / "eval.json"
    write_report(out, [draft], PROMPTS, lambda ids: "x" * len(ids), {"thinking": "off", "temperature": 0.6},
                 ks=[3, 5])
    report = json.loads(out.read_text())
    assert report["thinking"] == "off" and report["temperature"] == 0.6
    assert report["measured_acceptance_length"] == report["by_k"]["3"]["drafts"][0]["measured_acceptance_length"]
    assert set(report["by_k"]) == {"3", "5"}
    at5 = report["by_k"]["5"]["drafts"][0]
    assert at5["num_speculative_tokens"] == 5 and len(at5["acceptance_rate_per_position"]) == 5
    assert at5["by_prompt_set"]["humaneval"]["measured_acceptance_length"] == 3.0
    assert at5["by_prompt_set"]["mt-bench"]["by_category"]["writing"]["generations"] == 2
    # the offline metrics read at each k: the first k steps' accuracies
    assert report["simulated_acceptance_length"] == pytest.approx(1 + 0.4 + 0.1 + 0.0)
    assert at5["offline"]["cond_acc"] == OFFLINE["cond_acc"]
    assert report["drafts"][0]["generations"][1] == {
        "sample_id": "mt:81:2", "row": 1, "prompt_set": "mt-bench", "category": "writing", "turn": 2,
        "prompt_tokens": 1, "tokens": [5, 5, 5], "accepted_per_pass": [1], "text": "xxx"}


def test_tracker_scalars_at_each_k_and_served_beside():
    """The first draft's figures untagged by name, the others' (a reference, the baselines) under
    their names, no speculation left out; the offline figures read at each k; a set's name made
    one part of a tag; vLLM's counters under served/."""
    draft = DraftReport("draft", "d", {3: measured(3, ACCEPTED), 5: measured(5, ACCEPTED)}, offline=OFFLINE)
    ngram = DraftReport("n-gram", "lookup", {3: measured(3, [[0]] * 5), 5: measured(5, [[1]] * 5)})
    none = DraftReport("no speculation", "target alone", {3: measured(3, [[0]] * 5)})
    prompts = [*PROMPTS[:4], Prompt(4, "he:0", [1], "human eval", None, 1)]
    scalars = tracker_scalars([draft], {"ngram": ngram, "none": none}, prompts, [3, 5])
    assert sorted(scalars) == [3, 5]
    at3 = scalars[3]
    assert at3["evaluate/all/acceptance_length"] == pytest.approx(1 + 12 / 9)  # 12 accepted over 9 passes
    assert at3["evaluate/mt-bench/acceptance_length"] == pytest.approx(1 + 9 / 7)
    assert at3["evaluate/mt-bench/acceptance_rate/position_2"] == pytest.approx(3 / 7)
    assert at3["evaluate/mt-bench/category/math/acceptance_length"] == pytest.approx(1.5)
    assert at3["evaluate/human_eval/acceptance_length"] == 2.5
    assert at3["evaluate/all/ngram/acceptance_length"] == 1.0 and at3["evaluate/mt-bench/ngram/acceptance_length"] == 1
    assert at3["evaluate/offline/simulated_acceptance_length"] == pytest.approx(1.5)
    assert at3["evaluate/all/identical_to_greedy"] == 1.0 and not any("no speculation" in t or "/none/" in t
                                                                     for t in at3)
    assert "evaluate/all/acceptance_rate/position_5" in scalars[5] and "evaluate/all/acceptance_rate/position_4" \
        not in at3
    assert scalars[5]["evaluate/offline/simulated_acceptance_length"] == pytest.approx(1 + 0.4 + 0.1 + 0.0)

    served = {"draft": {3: VllmMeasured([[1, 2]], 2.0, drafts=4, accepted=6, accepted_per_pos=[3, 2, 1])},
              "reference": {3: VllmMeasured([[1, 2]], 1.0, drafts=4, accepted=2, accepted_per_pos=[2, 0, 0])}}
    figures = served_scalars(served, 10.0)[3]
    assert figures["evaluate/served/acceptance_length"] == 2.5
    assert figures["evaluate/served/acceptance_rate/position_1"] == 0.75
    assert figures["evaluate/served/reference/acceptance_length"] == 1.5
    assert figures["evaluate/served/tokens_per_s"] == 1.0 and figures["evaluate/served/plain/tokens_per_s"] == 10.0
