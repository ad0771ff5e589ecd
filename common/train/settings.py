"""Step 04's training settings: the `training` section of a draft config file, a run preset of
configs/presets/, and 04's flags, one per field of `TrainSettings` (derived here, not listed
beside it: `flag_specs`)."""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from common.draft.loss import LOSSES
from common.draft.model import DraftConfigFile, checked_fields
from common.errors import PipelineError
from common.trackers import TRACKERS

SCHEDULERS = ("linear", "cosine", "none")
OPTIMIZERS = ("muon", "adamw")
TTT_INPUTS = ("dataset", "draft")
INITS = ("normal", "torch")
PRECISIONS = ("auto", "bf16", "fp32")


def _setting(default: Any, text: str, **flag: Any) -> Any:
    """A field with the help text of its flag (and any other `add_argument` keywords)."""
    return field(default=default, metadata={"help": text, **flag})


@dataclass
class TrainSettings:
    """The `training` section of a draft config file, overridden by 04's flags of the same name."""

    epochs: int = _setting(3, "training epochs")
    lr: float = _setting(1e-4, "peak learning rate")
    ttt_steps: int = _setting(3, "draft tokens trained per position (test-time-training steps); may exceed the k "
                                 "served (--select-k), as the EAGLE-3 reference trains 7 with decay 0.8")
    ttt_step_loss_decay: float = _setting(1.0, "weight of TTT step k's loss is decay**k")
    select_k: int | None = _setting(None, "the k the draft will be served at (vLLM's num_speculative_tokens): the "
                                          "epoch exported is the one with the best validation simulated acceptance "
                                          "length at this k, and the exported config proposes k tokens (default: "
                                          "--ttt-steps)")
    loss: str = _setting("kl", "the divergence trained on, per token, between the target's p and the draft's q: "
                               "'kl' (forward KL, EAGLE-3's), 'tv' (total variation; acceptance = 1 - TV), 'lk' "
                               "(-log acceptance, LK^alpha of arXiv 2602.23881), 'lk-hybrid' (its LK^lambda: KL "
                               "blended into TV as acceptance grows), 'jsd' (Jensen-Shannon) or 'rkl' (reverse KL)")
    target_temperature: float = _setting(1.0, "temperature of the target's distribution the draft learns, p = "
                                              "softmax(logits / T): below 1 sharpens it toward the target's argmax, "
                                              "the token vLLM's verifier accepts a greedy draft's proposal by")
    ttt_inputs: str = _setting("dataset", "what TTT step k+1 reads in training: 'dataset' (the data's next tokens, "
                                          "teacher-forced, as upstream speculators) or 'draft' (the draft's own "
                                          "guesses of step k, this project's behaviour before)")
    optimizer: str = _setting("muon", "'muon' (torch.optim.Muon on the draft layers' and fc's weight matrices, AdamW "
                                      "on norms and lm_head, as upstream speculators) or 'adamw' (AdamW on all)")
    muon_lr: float | None = _setting(None, "peak learning rate of the Muon matrices (default: --lr; Muon's step is "
                                           "scaled to AdamW's RMS, so one rate fits both)")
    muon_weight_decay: float = _setting(0.1, "decoupled weight decay of the Muon matrices (upstream speculators' 0.1; "
                                             "AdamW's stays the library's 0.01)")
    freeze_draft_lm_head: bool = _setting(False, "keep the draft's lm_head at the target's (masked) lm_head, "
                                                 "as upstream speculators does")
    init: str = _setting("normal", "initial weights of the draft layers and fc: 'normal' (N(0, 0.02), transformers' "
                                   "post_init, as upstream speculators) or 'torch' (PyTorch's nn.Linear defaults, "
                                   "speculators 0.3.0's)")
    val_ratio: float = _setting(0.1, "share of samples held out for validation (0: none)")
    noise_std: float = _setting(0.05, "uniform noise on the auxiliary states, half-width (0: off)")
    total_seq_len: int = _setting(8192, "tokens packed into one training sequence per rank")
    grad_accum: int = _setting(1, "packed sequences whose gradients are summed into one optimizer step (tokens per "
                                  "step = N x --total-seq-len x ranks): the larger batch's update where memory holds "
                                  "one pack")
    activation_checkpointing: bool = _setting(False, "keep only each TTT step's inputs for the backward pass and "
                                                     "recompute the step there (about a third more compute, a "
                                                     "fraction of the activation memory); the loss is taken by "
                                                     "token tiles, never a whole [tokens x vocabulary] tensor")
    scheduler: str = _setting("linear", "learning-rate schedule: linear, cosine or none")
    warmup_steps: int | None = _setting(None, "warm-up steps (default: 1%% of all steps, the library's)")
    num_workers: int = _setting(0, "data-loader worker processes")
    seed: int = _setting(0, "seed of the packing order, the noise and the draft's initialisation")
    split_seed: int = _setting(0, "seed of the held-out split, apart from --seed so that runs of other seeds are "
                                  "validated (and 05 measures them) on the same rows")
    precision: str = _setting("auto", "the draft's compute: 'bf16' (autocast: matmuls in bf16, weights, optimizer "
                                      "and loss in fp32, as upstream speculators trains), 'fp32', or 'auto' (bf16 on "
                                      "GPUs, where fp32 matmuls run at a fraction of the tensor cores' rate; fp32 on "
                                      "CPUs, where bf16 is slower)")
    save_every: int = _setting(0, "optimizer steps between step checkpoints in checkpoints/steps/ (the last 2 are "
                                  "kept; 0: at the end of each epoch only)")
    report_to: list[str] | None = _setting(None, "experiment trackers: none, or one or more of tensorboard (into "
                                                 "OUTPUT/tensorboard/train/), wandb, trackio (default: tensorboard "
                                                 "when installed, else none)", choices=("none", *TRACKERS),
                                           metavar="TRACKER")
    log_every: int = _setting(1, "optimizer steps between the scalars sent to the trackers (the gradient norm and "
                                 "memory are read only then)")

    @classmethod
    def resolve(cls, file: DraftConfigFile, flags: dict[str, Any],
                preset: Path | None = None) -> tuple[TrainSettings, list[str]]:
        """(settings, one line per value that overrode the file). Precedence: the config file's
        `training` section, then a run preset (`configs/presets/`), then flags (None = unset)."""
        values = {f.name: f.default for f in fields(cls)}
        values.update(checked_fields(cls, file.training, f"draft config {file.path} [training]"))
        overrides = []
        layers = [(f"preset {preset}", read_preset(preset))] if preset is not None else []
        layers.append(("", {f"--{k.replace('_', '-')}": v for k, v in flags.items()}))
        for source, layer in layers:
            for key, value in layer.items():
                name = key.removeprefix("--").replace("-", "_")
                if value is not None:
                    where = f"{source}: {name}" if source else key
                    overrides.append(f"{where} {value} overrides {values[name]}")
                    values[name] = value
        settings = cls(**values)
        settings.check()
        return settings, overrides

    def check(self) -> None:
        rules = [(f"--epochs {self.epochs}", self.epochs >= 1, "at least 1"),
                 (f"--lr {self.lr}", self.lr > 0, "positive"),
                 (f"--muon-lr {self.muon_lr}", self.muon_lr is None or self.muon_lr > 0, "positive"),
                 (f"--muon-weight-decay {self.muon_weight_decay}", self.muon_weight_decay >= 0, "0 or more"),
                 (f"--ttt-steps {self.ttt_steps}", self.ttt_steps >= 1, "at least 1"),
                 (f"--ttt-step-loss-decay {self.ttt_step_loss_decay}", self.ttt_step_loss_decay > 0, "positive"),
                 (f"--select-k {self.select_k}", self.select_k is None or self.select_k >= 1, "at least 1"),
                 (f"--loss {self.loss}", self.loss in LOSSES, f"one of {', '.join(LOSSES)}"),
                 (f"--target-temperature {self.target_temperature}", self.target_temperature > 0, "positive"),
                 (f"--ttt-inputs {self.ttt_inputs}", self.ttt_inputs in TTT_INPUTS, f"one of {', '.join(TTT_INPUTS)}"),
                 (f"--optimizer {self.optimizer}", self.optimizer in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
                 (f"--init {self.init}", self.init in INITS, f"one of {', '.join(INITS)}"),
                 (f"--precision {self.precision}", self.precision in PRECISIONS, f"one of {', '.join(PRECISIONS)}"),
                 (f"--val-ratio {self.val_ratio}", 0 <= self.val_ratio < 1, "in [0, 1)"),
                 (f"--noise-std {self.noise_std}", self.noise_std >= 0, "0 or more"),
                 (f"--total-seq-len {self.total_seq_len}", self.total_seq_len >= 2, "at least 2"),
                 (f"--grad-accum {self.grad_accum}", self.grad_accum >= 1, "at least 1"),
                 (f"--scheduler {self.scheduler}", self.scheduler in SCHEDULERS, f"one of {', '.join(SCHEDULERS)}"),
                 # the library reads 0 as unset (`warmup or default`), so 0 cannot be honoured
                 (f"--warmup-steps {self.warmup_steps}", self.warmup_steps is None or self.warmup_steps >= 1,
                  "at least 1 (leave it unset for 1% of all steps)"),
                 (f"--num-workers {self.num_workers}", self.num_workers >= 0, "0 or more"),
                 (f"--save-every {self.save_every}", self.save_every >= 0, "0 (off) or more"),
                 (f"--log-every {self.log_every}", self.log_every >= 1, "at least 1"),
                 (f"--report-to {' '.join(self.report_to or [])}",
                  self.report_to is None or (bool(self.report_to) and set(self.report_to) <= {"none", *TRACKERS}),
                  f"none or some of {', '.join(TRACKERS)}")]
        for flag, ok, rule in rules:
            if not ok:
                raise PipelineError(f"{flag}: must be {rule}")

    def autocast_dtype(self, device: torch.device) -> torch.dtype | None:
        """The dtype the draft's forward autocasts to on `device` (None: plain fp32)."""
        bf16 = self.precision == "bf16" or (self.precision == "auto" and device.type == "cuda")
        return torch.bfloat16 if bf16 else None

    @property
    def served_k(self) -> int:
        """The k the draft is chosen and exported for (`--select-k`, default `--ttt-steps`)."""
        return self.select_k or self.ttt_steps

    def call_kwargs(self) -> dict[str, Any]:
        """The draft's forward arguments of a validation pass: TTT steps read the draft's own
        guesses, as they do when the draft serves, as many as trained and at least the served k
        (the simulated acceptance length at k needs k steps)."""
        return {"ttt_steps": max(self.ttt_steps, self.served_k), "ttt_step_loss_decay": self.ttt_step_loss_decay}

    def train_call_kwargs(self) -> dict[str, Any]:
        """The draft's forward arguments of a training step (the library's name for teacher forcing:
        `use_off_policy_tokens`)."""
        return {"ttt_steps": self.ttt_steps, "ttt_step_loss_decay": self.ttt_step_loss_decay,
                "use_off_policy_tokens": self.ttt_inputs == "dataset"}


def flag_specs() -> dict[str, dict[str, Any]]:
    """Field name -> `add_argument` keywords of its flag, every default None (unset: the config
    file's value stands). A bool field gets `--name` / `--no-name`."""
    hints = typing.get_type_hints(TrainSettings)
    return {f.name: _flag_spec(f, hints[f.name]) for f in fields(TrainSettings)}


def _flag_spec(f: Field, hint: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"default": None, **f.metadata}
    if hint is bool:
        return {**spec, "action": argparse.BooleanOptionalAction}
    kinds = [t for t in typing.get_args(hint) if t is not type(None)]  # `int | None` -> int
    kind = kinds[0] if kinds else hint
    if typing.get_origin(kind) is list:  # `list[str] | None` -> one or more values
        return {**spec, "nargs": "+", "type": typing.get_args(kind)[0]}
    return {**spec, "type": kind}


def read_preset(path: Path) -> dict[str, Any]:
    """The `training` section of a run preset (configs/presets/*.json), checked like a config's."""
    if not Path(path).is_file():
        raise PipelineError(f"preset {path}: no such file")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PipelineError(f"preset {path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("training"), dict) or set(data) - {"comment", "training"}:
        raise PipelineError(f"preset {path}: expected an object with a 'training' section (and an optional 'comment')")
    return checked_fields(TrainSettings, data["training"], f"preset {path} [training]")
