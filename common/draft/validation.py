"""A draft's figures on held-out hidden states, as speculators' Trainer computes them in a validation
pass (`validation_metrics`), and their summary (`ValSummary`): loss, full and conditional accuracy per
TTT step, and the simulated acceptance length. 04 reports its validation passes with them, 05 its
offline figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader


def per_step(metrics: dict[str, float], name: str) -> list[float]:
    """[metrics["name_0"], metrics["name_1"], ...] for the TTT steps present."""
    values, k = [], 0
    while f"{name}_{k}" in metrics:
        values.append(metrics[f"{name}_{k}"])
        k += 1
    return values


def simulated_acceptance_length(cond_accs: list[float]) -> float:
    """1 + sum over k of prod_{j<=k} cond_acc_j: the expected tokens per verification step when
    draft token k is accepted only if tokens 0..k-1 were."""
    total, run = 1.0, 1.0
    for acc in cond_accs:
        run *= acc
        total += run
    return total


@dataclass
class ValSummary:
    epoch: int
    loss: float
    full_acc: list[float]
    cond_acc: list[float]
    loss_per_step: list[float]
    acceptance_length: float  # simulated, at k
    k: int  # draft tokens per verification the acceptance length is simulated for

    @classmethod
    def from_metrics(cls, metrics: dict[str, float], epoch: int, k: int | None = None) -> ValSummary:
        """`k`: the served k (default: every TTT step validated)."""
        cond = per_step(metrics, "cond_acc")
        k = len(cond) if k is None else min(k, len(cond))
        return cls(epoch=epoch, loss=metrics["loss"], full_acc=per_step(metrics, "full_acc"), cond_acc=cond,
                   loss_per_step=per_step(metrics, "loss"), acceptance_length=simulated_acceptance_length(cond[:k]),
                   k=k)

    def lines(self) -> list[str]:
        rows = [f"validation after epoch {self.epoch + 1}: loss {self.loss:.4f}",
                "  TTT step   loss      full acc   cond acc"]
        rows += [f"  {k:>8}   {lo:<8.4f}  {fa:<9.3f}  {ca:.3f}"
                 for k, (lo, fa, ca) in enumerate(zip(self.loss_per_step, self.full_acc, self.cond_acc))]
        rows.append(f"simulated acceptance length at k = {self.k}: {self.acceptance_length:.3f} "
                    "(1 + sum over steps i < k of the product of cond acc up to i)")
        return rows


@torch.no_grad()
def validation_metrics(model: torch.nn.Module, loader: DataLoader, device: torch.device, call_kwargs: dict[str, Any],
                       epoch: int = 0) -> dict[str, float]:
    """Validation metrics as the Trainer computes them (mean over batches), for any model, called with
    the draft's forward arguments of a validation pass (04's `TrainSettings.call_kwargs()`)."""
    model.eval()
    loader.batch_sampler.set_epoch(epoch)
    totals: dict[str, float] = {}
    for batch in loader:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        _tokens, _loss, metrics = model(**batch, **call_kwargs)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v.item()
    return {k: v / len(loader) for k, v in totals.items()}
