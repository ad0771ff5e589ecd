"""common/train/metrics.py: the choice of the checkpoint to export."""

from __future__ import annotations

import pytest

from common.train.metrics import best_validation


def test_best_validation_picks_the_highest_simulated_acceptance_length():
    def record(epoch: int, acc: float) -> dict:
        return {"epoch": epoch, "val": {"loss_epoch": 1.0, **{f"{m}_{k}_epoch": acc for m in ("full_acc", "cond_acc",
                                                                                          "loss") for k in range(2)}}}

    records = [record(0, 0.3), {"epoch": 0, "train": {}}, record(1, 0.6), record(2, 0.5), record(3, 0.6)]
    assert best_validation(records, [0, 1, 2, 3]).epoch == 3  # a tie goes to the later epoch
    assert best_validation(records, [0, 1, 2]).epoch == 1  # only epochs with a checkpoint
    assert best_validation(records, [0, 1, 2]).acceptance_length == pytest.approx(1 + 0.6 + 0.36)
    assert best_validation([{"epoch": 0, "train": {}}], [0]) is None



def test_best_validation_at_the_served_k():
    """With more TTT steps validated than served, the epoch is chosen by the simulated acceptance
    length over the first k steps: here epoch 0 is better at k = 1, epoch 1 at k = 3."""
    def record(epoch: int, accs: list[float]) -> dict:
        return {"epoch": epoch, "val": {"loss_epoch": 1.0, **{f"{m}_{k}_epoch": a for m in ("full_acc", "cond_acc",
                                                                                        "loss")
                                                             for k, a in enumerate(accs)}}}

    records = [record(0, [0.8, 0.1, 0.1]), record(1, [0.7, 0.9, 0.9])]
    assert best_validation(records, [0, 1], k=1).epoch == 0
    assert best_validation(records, [0, 1], k=1).acceptance_length == pytest.approx(1.8)
    assert best_validation(records, [0, 1], k=3).epoch == best_validation(records, [0, 1]).epoch == 1
    assert best_validation(records, [0, 1], k=3).k == 3
