"""EAGLE-3.1's two norms on speculators 0.3.0's EAGLE-3 draft, as speculators 0.9.0 trains them (its
eagle3 defaults since #692) and vLLM serves them (config.json keys `norm_before_fc` and
`norm_output`, read by vLLM's `llama_eagle3.py`):

- `norm_before_fc`: one RMSNorm over the concatenated auxiliary states [3H] before `fc`; its weight
  is `input_norm.weight`, which vLLM loads as `model.input_norm`.
- `norm_output`: the state a draft step hands to the next is the final norm's output, not the
  pre-norm sum (vLLM: `aux_output = hidden_states if norm_output else hidden_prenorm`); the
  logits are lm_head(norm(h)) either way.

0.3.0's forward computes fc(aux), runs the layers, takes lm_head(norm(h)) and hands h to the next
TTT step. Rather than a copy of that forward, hooks on one draft's modules change what flows, so
every caller of those modules (the library's forward, compiled or not; 05's proposer) computes the
same thing vLLM does:
- a forward pre-hook on `fc` applies `input_norm` to its input;
- a forward hook on the last decoder layer returns norm(h) in place of h (calling the norm's
  `forward`, which runs no hooks), and a forward hook on `norm` returns its input unchanged: so
  `lm_head(norm(...))` sees norm(h), normed once, and the next step reads norm(h).
"""

from __future__ import annotations

import torch
from speculators.models.eagle3 import Eagle3DraftModel

NORMS = ("norm_before_fc", "norm_output")


def norms_of(config) -> dict[str, bool]:
    """The two settings of an `Eagle3SpeculatorConfig` (extra fields of 0.3.0's config; False when
    absent, as in every draft saved before them)."""
    return {name: bool(getattr(config, name, False)) for name in NORMS}


def install(model: Eagle3DraftModel, norm_before_fc: bool, norm_output: bool) -> None:
    """Add the chosen norms to a freshly built draft (before its weights are loaded or sharded)."""
    if norm_before_fc:
        eps = model.config.transformer_layer_config.rms_norm_eps
        model.input_norm = model._model_definitions.norm_class(model.fc.in_features, eps=eps)
        model.fc.register_forward_pre_hook(_InputNorm(model.input_norm))
    if norm_output:
        model.layers[-1].register_forward_hook(_NormedOutput(model.norm))
        model.norm.register_forward_hook(_pass_through)


class _InputNorm:
    """fc's forward pre-hook: fc(input_norm(x))."""

    def __init__(self, norm: torch.nn.Module) -> None:
        self.norm = norm

    def __call__(self, _fc: torch.nn.Module, args: tuple) -> tuple:
        return (self.norm(args[0]), *args[1:])


class _NormedOutput:
    """The last decoder layer's forward hook: its output h becomes norm(h)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        self.norm = norm

    def __call__(self, _layer: torch.nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.norm.forward(output)  # not __call__: _pass_through would hand h back


def _pass_through(_norm: torch.nn.Module, args: tuple, _output: torch.Tensor) -> torch.Tensor:
    """The final norm's forward hook: its input, already normed by `_NormedOutput`."""
    return args[0]
