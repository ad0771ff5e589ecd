"""Step 04's optimizers and learning-rate schedule, built where the library's Trainer builds its own
(`ProjectTrainer.setup_optimizer`).

speculators 0.3.0 hard-codes AdamW over every parameter; upstream speculators (0.9.0) defaults to
Muon for the 2-D weight matrices and AdamW for embeddings, norms and heads. Both are here:

    adamw   the library's own optimizer, unchanged: `AdamW(model.named_parameters(), lr)`
    muon    `torch.optim.Muon` on the weight matrices of the draft's decoder layers and of `fc`,
            AdamW on the rest that trains (the norms, the draft lm_head unless frozen)

The Trainer, the library's checkpointers and the scheduler each take one optimizer object, so
the two are driven through one `MuonWithAdamW`, a `torch.optim.Optimizer` whose parameter groups
and state are those of its two members: its `state_dict` is one ordinary optimizer state dict,
saved, resumed and (under FSDP) gathered by the library's code unchanged.

Muon's step is scaled to the RMS of an AdamW step (`adjust_lr_fn="match_rms_adamw"`, Moonlight's
rule), so the AdamW learning rate carries over (`muon_lr` defaults to `lr`).
"""

from __future__ import annotations

import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from common.train.settings import TrainSettings

WEIGHT_DECAY = 0.01  # AdamW's default in torch, the library's (Muon's is `--muon-weight-decay`, 0.1 by default)
MUON_MODULES = ("layers.", "fc.")  # the draft's own matrices; embed_tokens and the lm_heads come from the target


def muon_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable weight matrices of the decoder layers and fc, with their names."""
    return [(name, p) for name, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and name.startswith(MUON_MODULES)]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_params`, AdamW on `adamw_params`, as one optimizer: groups `[muon, adamw]`
    (each member's groups are list items of this one's, the same dicts) and one state."""

    def __init__(self, muon_params: list[tuple[str, torch.nn.Parameter]],
                 adamw_params: list[tuple[str, torch.nn.Parameter]], lr: float, muon_lr: float,
                 muon_weight_decay: float) -> None:
        self.muon = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=muon_weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=WEIGHT_DECAY)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], defaults={})
        self._link()

    def _link(self) -> None:
        """Point both members at this optimizer's groups and state (after `load_state_dict`
        replaced them)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


def build_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(model.named_parameters(), lr=settings.lr)  # the library's, unchanged
    matrices = muon_parameters(model)
    chosen = {id(p) for _, p in matrices}
    rest = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    return MuonWithAdamW(matrices, rest, settings.lr, settings.muon_lr or settings.lr, settings.muon_weight_decay)


def group_learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The current learning rate of each member: {"muon": .., "adamw": ..} (the first group's of each),
    or {"adamw": ..} for AdamW alone."""
    if isinstance(optimizer, MuonWithAdamW):
        return {"muon": optimizer.muon.param_groups[0]["lr"], "adamw": optimizer.adamw.param_groups[0]["lr"]}
    return {"adamw": optimizer.param_groups[0]["lr"]}


def build_scheduler(optimizer: torch.optim.Optimizer, settings: TrainSettings,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The library's schedule (its `setup_optimizer`): warm-up of `warmup_steps` (default 1% of
    all steps), then linear or half-cosine decay to 0 at the last step; None for 'none'."""
    if settings.scheduler == "none":
        return None
    total = settings.epochs * steps_per_epoch
    warmup = settings.warmup_steps or total // 100
    if settings.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total)
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total, num_cycles=0.5)
