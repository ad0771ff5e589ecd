"""The draft's loss: speculators 0.3.0's `compute_metrics` (called once per TTT step) computed over
the verifier's softmax made once per batch, and the divergences the draft can train on.

    from common.draft.loss import DraftLoss
    metrics = DraftLoss("lk", target_temperature=0.5).compute_metrics  # the library's signature

The library's `compute_metrics` takes the softmax of the verifier's logits and their argmax again at
every step, and writes its KL divergence as a [tokens, vocabulary] product, masked element by element,
for the loss to sum. `DraftLoss.compute_metrics` computes the softmax, the target entropy term and the
argmax once per batch and slices them per step (softmax and argmax work row by row, so a row's values
are the same), and masks per token after summing over the vocabulary. The gradients are bitwise the
library's (the same products in the same order: see `kl_loss`); the loss value it logs differs from
the library's by float rounding of the sum. Eager, the KL loss of TTT steps after the first reads
the draft's logits unsliced, its targets padded with rows of zeros instead (`kl_loss_aligned`): the
same bits without the [tokens x vocabulary] zeros and copy the slice's backward writes per step. It also offers the losses aimed at acceptance itself
(`LOSSES`, defined in `divergence`), which 0.3.0 lacks, and a temperature for the verifier's
distribution (see `verifier_targets`).

`common.draft.patch.apply(loss=..., target_temperature=...)` installs a `DraftLoss` into the library.
Compiled with the KL loss at temperature 1, the library's function stays: the compiler fuses its
elementwise work itself. `common.draft.forward` takes the same loss by tiles of tokens with these
functions (a tile's `verifier_targets`, `step_loss` over the step's `mean_denominator`, `accuracy_of`).
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from speculators.models.eagle3 import core as library_core

LOSSES = ("kl", "tv", "lk", "lk-hybrid", "jsd", "rkl")
LK_HYBRID_ETA = 3.0  # the LK paper's best hybrid setting (arXiv 2602.23881), upstream's default
OVERLAP_FLOOR = 1e-5  # -log of the overlap is taken at no less than this (upstream's `_NLA_EPS`)
LOG_P_LOSSES = ("jsd", "rkl")  # the losses that read the verifier's log-softmax
# Rows of zeros after the KL loss's targets: TTT steps 1..PAD_ROWS read theirs without slicing the draft's
# logits (see `kl_loss_aligned`); a later step slices them, as the library does.
PAD_ROWS = 8


class VerifierTargets(NamedTuple):
    """What every TTT step of one batch reads from the verifier's logits [1, T, V]: their softmax,
    the per-token sum of p log p (the KL divergence's entropy term), the argmax, and (for the
    losses that need it) their log-softmax. `p_rows`, where made: the softmax followed by
    `pad_rows` rows of zeros ([1, T + pad_rows, V], `p` its first T rows), so that TTT step k reads
    its targets as the view `p_rows[:, k:k + T]`, aligned with all T of the draft's logits."""

    p: torch.Tensor
    p_log_p: torch.Tensor
    ids: torch.Tensor
    log_p: torch.Tensor | None
    p_rows: torch.Tensor | None = None


def verifier_targets(logits: torch.Tensor, name: str = "kl", temperature: float = 1.0,
                     pad_rows: int = 0) -> VerifierTargets:
    """The targets of one batch for the loss `name`, from the verifier's distribution at
    `temperature`: p = softmax(logits / T). Below 1 it is sharpened toward the verifier's argmax, the
    token that decides acceptance where the draft proposes its own argmax (vLLM's default draft
    sampling: the rejection sampler then accepts it with the verifier's probability of it, at any
    serving temperature), while keeping the rest of the distribution's ranking. The argmax, and so
    the accuracies, do not depend on T. `pad_rows` > 0 (eager, [1, T, V] logits): the softmax is
    written into the first rows of `p_rows`, zeros after them (see `VerifierTargets`), in the logits'
    dtype: the same bits as a softmax of its own."""
    scaled = logits if temperature == 1.0 else logits / temperature
    p_rows = None
    if pad_rows > 0:
        batch, rows, vocab = scaled.shape
        p_rows = scaled.new_empty(batch, rows + pad_rows, vocab)
        p_rows[:, rows:].zero_()
        p = torch.softmax(scaled, dim=-1, out=p_rows[:, :rows])  # a contiguous view: the softmax's own bits
    else:
        p = torch.softmax(scaled, dim=-1)
    return VerifierTargets(p=p, p_log_p=torch.special.xlogy(p, p).sum(-1),  # [1, T]; 0 where p underflows to 0
                           ids=torch.argmax(logits, dim=-1),
                           log_p=torch.log_softmax(scaled, dim=-1) if name in LOG_P_LOSSES else None, p_rows=p_rows)


def mean_denominator(loss_mask: torch.Tensor | None, tokens: int) -> torch.Tensor | int:
    """What the library divides a step's summed loss by: the count of masked tokens (+1e-5), or the
    step's `tokens` without a mask. Known before any token's loss, so a step taken by tiles of
    tokens divides each tile's sum by it (`common.draft.forward`)."""
    return loss_mask.sum(dim=1) + 1e-5 if loss_mask is not None else tokens


def masked_mean(per_token: torch.Tensor, loss_mask: torch.Tensor | None,
                denominator: torch.Tensor | int | None = None) -> torch.Tensor:
    """The library's reduction: the sum over the masked tokens divided by their count (+1e-5).
    `denominator`: the whole step's (`mean_denominator`) where `per_token` is one tile of it."""
    if denominator is None:
        denominator = mean_denominator(loss_mask, per_token.shape[1])
    if loss_mask is not None:
        per_token = per_token * loss_mask
    return (per_token.sum(dim=1) / denominator).mean()


def kl_loss(logits: torch.Tensor, p: torch.Tensor, p_log_p: torch.Tensor, loss_mask: torch.Tensor | None,
            denominator: torch.Tensor | int | None = None) -> torch.Tensor:
    """The library's `loss_function` (KL(p || softmax(logits)), summed over the vocabulary and the
    masked tokens, divided by their count). Its backward reaches `log_softmax` as
    `-p * (g / denominator * mask)`, the product the library's `kl_div` backward forms: a 0/1
    mask multiplies the same scalar on either side, so the gradients are the same bits."""
    cross = (p * F.log_softmax(logits, dim=-1)).sum(-1)  # [1, T']
    return masked_mean(p_log_p - cross, loss_mask, denominator)


def kl_loss_aligned(logits: torch.Tensor, t: VerifierTargets, step: int, loss_mask: torch.Tensor | None,
                    denominator: torch.Tensor | int | None = None) -> torch.Tensor:
    """`kl_loss` of TTT step `step` (>= 1) over all T of the draft's logits [1, T, V], unsliced:
    the library's `align_for_step` takes `logits[:, :-step]`, whose backward writes the gradient
    into a new [T, V] tensor of zeros (a fill and a copy of T x V floats per step). Here the
    log-softmax of every row is multiplied by the targets' view `t.p_rows[:, step:step + T]`,
    whose last `step` rows are zeros, and the per-token sums are sliced instead ([1, T]). Each
    of the first T - step rows is the same row operations on the same values, so the loss is the
    same bits as `kl_loss` of the sliced logits, and so is each row's gradient; the last rows get
    zeros (0 x 0), as the slice's backward gives them."""
    total = logits.shape[1]
    p = t.p_rows[:, step:step + total]
    cross = (p * F.log_softmax(logits, dim=-1)).sum(-1)[:, :total - step]  # [1, T - step]
    return masked_mean(t.p_log_p[:, step:] - cross, loss_mask, denominator)


def divergence(name: str, logits: torch.Tensor, t: VerifierTargets, step: int) -> torch.Tensor:
    """Per token [1, T'], between the verifier's p (the batch's targets from TTT step `step` on)
    and the draft's q = softmax(logits), as speculators 0.9.0's `losses/eager.py` defines them:
    - tv: total variation 1 - sum_v min(p_v, q_v). The acceptance probability of speculative
      sampling is sum_v min(p_v, q_v) = 1 - TV(p, q) (Leviathan et al. 2023, Thm 3.5).
    - lk: -log sum_v min(p_v, q_v), the negative log acceptance rate: the LK^alpha loss of
      "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding" (Samarin et al.,
      arXiv 2602.23881; upstream's "nla"); its gradient is TV's divided by the acceptance rate, so
      it does not vanish while the draft is far from the target.
    - lk-hybrid: lambda KL(p || q) + (1 - lambda) TV(p, q), lambda = exp(-eta sg(alpha)) with
      eta 3: the same paper's LK^lambda, KL's gradient early, TV's as acceptance grows.
    - jsd: 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2 (Lin 1991).
    - rkl: reverse KL(q || p), mode-seeking.
    jsd and rkl read `t.log_p`, which `verifier_targets` makes for them."""
    p = t.p[:, step:]
    if name in ("tv", "lk", "lk-hybrid"):
        overlap = torch.minimum(torch.softmax(logits, dim=-1), p).sum(-1)
        if name == "tv":
            return 1.0 - overlap
        if name == "lk":
            return -torch.log(overlap.clamp_min(OVERLAP_FLOOR))
        kl = t.p_log_p[:, step:] - (p * F.log_softmax(logits, dim=-1)).sum(-1)
        weight = torch.exp(-LK_HYBRID_ETA * overlap.detach())
        return weight * kl + (1.0 - weight) * (1.0 - overlap)
    log_q, log_p = F.log_softmax(logits, dim=-1), t.log_p[:, step:]
    if name == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_q, log_p) - math.log(2.0)
    return 0.5 * ((p * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))


def step_loss(name: str, logits: torch.Tensor, t: VerifierTargets, step: int,
              loss_mask: torch.Tensor | None, denominator: torch.Tensor | int | None = None) -> torch.Tensor:
    """One TTT step's loss under the divergence `name`: the library's KL for "kl", otherwise the
    masked mean of `divergence`. With `denominator` (the step's `mean_denominator`), the share of
    the step's loss of the tokens given: one tile's."""
    if name == "kl":
        return kl_loss(logits, t.p[:, step:], t.p_log_p[:, step:], loss_mask, denominator)
    return masked_mean(divergence(name, logits, t, step), loss_mask, denominator)


@torch.no_grad()
def accuracy(logits: torch.Tensor, target_ids: torch.Tensor, loss_mask: torch.Tensor | None,
             prev_correct: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's `compute_accuracy`, given the verifier's argmax instead of its logits."""
    return accuracy_of(torch.argmax(logits, dim=-1), target_ids, loss_mask, prev_correct)


@torch.no_grad()
def accuracy_of(draft_ids: torch.Tensor, target_ids: torch.Tensor, loss_mask: torch.Tensor | None,
                prev_correct: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`accuracy` given the draft's argmax too (a step taken by tiles never holds all its logits)."""
    correct = draft_ids == target_ids
    cond_denom: torch.Tensor | int = correct.numel()
    if prev_correct is not None:
        cond_denom = prev_correct.sum()
        correct = torch.logical_and(prev_correct, correct, out=prev_correct)  # in place, as the library's
    if loss_mask is not None:
        correct = torch.masked_select(correct, loss_mask.to(torch.bool))
    correct_sum = correct.float().sum()
    return correct_sum / (correct.numel() + 1e-5), correct_sum / (cond_denom + 1e-5)


class DraftLoss:
    """The loss the draft trains on: the divergence `name` (one of `LOSSES`, see `divergence`)
    toward the verifier's distribution at `target_temperature` (see `verifier_targets`).
    `compute_metrics` is the library's function with this choice; the instance keeps the current
    batch's `VerifierTargets`, so a new instance starts with none."""

    def __init__(self, name: str = "kl", target_temperature: float = 1.0) -> None:
        if name not in LOSSES:
            raise ValueError(f"loss {name!r}: expected one of {', '.join(LOSSES)}")
        if not target_temperature > 0:
            raise ValueError(f"target_temperature {target_temperature}: must be positive")
        self.name, self.target_temperature = name, float(target_temperature)
        # The batch's, with a weak reference to the logits they come from: the forward passes the
        # same logits tensor to every TTT step.
        self._targets: tuple[weakref.ref, VerifierTargets] | None = None

    def __repr__(self) -> str:
        return f"DraftLoss({self.name!r}, target_temperature={self.target_temperature})"

    @property
    def is_library_loss(self) -> bool:
        """Whether this is the library's own loss: KL toward the verifier at temperature 1."""
        return self.name == "kl" and self.target_temperature == 1.0

    def targets_of(self, logits: torch.Tensor) -> VerifierTargets:
        """The batch's `VerifierTargets`, made at its first TTT step. A compiled forward makes them
        at every step (the compiler fuses that work itself, and a cache is not traceable)."""
        if torch.compiler.is_compiling():
            return verifier_targets(logits, self.name, self.target_temperature)
        if self._targets is None or self._targets[0]() is not logits:
            self._targets = None  # the last batch's are freed before the new ones are made
            # KL in plain precision (under autocast the softmax is made in its own dtype, as before)
            plain = self.name == "kl" and logits.dim() == 3 and not torch.is_autocast_enabled(logits.device.type)
            pad = PAD_ROWS if plain else 0
            self._targets = (weakref.ref(logits), verifier_targets(logits, self.name, self.target_temperature, pad))
        return self._targets[1]

    def compute_metrics(self, logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None,
                        prev_correct: torch.Tensor | None, ttt_step: int,
                        ttt_step_loss_decay: float) -> tuple[torch.Tensor, dict]:
        """The library's `compute_metrics` (same arguments, results and in-place update of
        `prev_correct`) over the batch's `VerifierTargets`, sliced to the step, with this loss."""
        t = self.targets_of(targets)
        s_logits, _, s_loss_mask, s_prev_correct = library_core.align_for_step(logits, targets, loss_mask,
                                                                               prev_correct, ttt_step)
        if t.p_rows is not None and 0 < ttt_step <= t.p_rows.shape[1] - t.p.shape[1]:
            s_loss = ttt_step_loss_decay**ttt_step * kl_loss_aligned(logits, t, ttt_step, s_loss_mask)
        else:
            s_loss = ttt_step_loss_decay**ttt_step * step_loss(self.name, s_logits, t, ttt_step, s_loss_mask)
        full_acc, cond_acc = accuracy(s_logits, t.ids[:, ttt_step:], s_loss_mask, s_prev_correct)
        return s_loss, {f"loss_{ttt_step}": s_loss.detach().clone(), f"full_acc_{ttt_step}": full_acc,
                        f"cond_acc_{ttt_step}": cond_acc}
