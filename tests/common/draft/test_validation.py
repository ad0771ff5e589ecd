"""common/draft/validation.py: the simulated acceptance length and the validation summary."""

from __future__ import annotations

import pytest

from common.draft.validation import ValSummary, simulated_acceptance_length


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert simulated_acceptance_length([1.0, 1.0]) == 3.0
    assert simulated_acceptance_length([0.0, 0.9]) == 1.0


def test_summary_reads_the_trainers_metric_names():
    metrics = {"loss": 3.0, "loss_0": 1.0, "loss_1": 2.0, "full_acc_0": 0.5, "full_acc_1": 0.2,
               "cond_acc_0": 0.5, "cond_acc_1": 0.4}
    summary = ValSummary.from_metrics(metrics, epoch=2)
    assert (summary.loss, summary.loss_per_step, summary.full_acc, summary.cond_acc) == (3.0, [1.0, 2.0], [0.5, 0.2],
                                                                                        [0.5, 0.4])
    assert summary.acceptance_length == pytest.approx(1 + 0.5 + 0.2)
    assert summary.lines()[0] == "validation after epoch 3: loss 3.0000"


def test_summary_at_a_served_k_below_the_steps_validated():
    metrics = {"loss": 3.0, **{f"{m}_{k}": 0.5 for m in ("loss", "full_acc", "cond_acc") for k in range(4)}}
    summary = ValSummary.from_metrics(metrics, epoch=0, k=2)
    assert (summary.k, len(summary.cond_acc)) == (2, 4)
    assert summary.acceptance_length == pytest.approx(1 + 0.5 + 0.25)
    assert "simulated acceptance length at k = 2: 1.750" in summary.lines()[-1]
    assert ValSummary.from_metrics(metrics, epoch=0).k == 4
