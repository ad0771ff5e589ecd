"""The EAGLE-3 draft model: its config file (`configs/`), the speculators config built from it and
the target, the exported folder `RUN/draft/`, and the loader for that folder.

A draft config file holds two sections: `model` (the draft's shape, `DraftShape`) and
`training` (defaults of 04's training flags, see `common.train.settings.TrainSettings`); unknown keys
and wrong types are errors. Everything the draft must share with the target (vocabulary size,
norm epsilon, rope theta and scaling, maximum positions) is copied from the target's text
config, never from the file: the official 0.3.0 example leaves the rope at Llama's default
theta 10000, while Kimi-K2.5 uses yarn with theta 50000.

The exported folder is speculators' format as vLLM reads it: `config.json`
(`speculators_model_type: eagle3`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`,
`transformer_layer_config` with the target's rope settings, a `verifier` block with the
target's path and architecture, and EAGLE-3.1's `norm_before_fc` / `norm_output`) and
`model.safetensors` in bf16 with `d2t`/`t2d` (and `input_norm.weight` with `norm_before_fc`) and
without `verifier_lm_head` (a frozen copy of the target's lm_head rows, used only to make training
targets). A draft that predicts the target's whole vocabulary (03's identity map) is written without
`d2t`/`t2d`, as speculators 0.9.0 writes one: vLLM's EAGLE-3 loader has no parameter for `d2t` when
the two vocabularies are the same size and refuses a draft that carries it. speculators 0.3.0's
`Eagle3DraftModel.from_pretrained` fails on such a folder (`unexpected keyword argument
'verifier'`), so `load_draft` builds the model itself.
"""

from __future__ import annotations

import copy
import json
import types
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

from common.atomic import write_dir, write_json
from common.defaults import CONFIG_DIR
from common.draft import eagle31, patch
from common.draft.eagle31 import norms_of
from common.errors import PipelineError
from common.target.config import TargetInfo

TINY_CONFIG = CONFIG_DIR / "draft_tiny.json"
KIMI_CONFIG = CONFIG_DIR / "draft_kimi_k25.json"
# The draft config of each built-in real target (common.defaults.REAL_TARGETS), by its --target name.
REAL_TARGET_CONFIGS = {"smollm2": CONFIG_DIR / "draft_smollm2.json"}
CONFIG_SECTIONS = ("comment", "model", "training")
WEIGHTS_FILE = "model.safetensors"
EXPORT_DTYPE = torch.bfloat16
NOT_EXPORTED = ("verifier_lm_head.weight",)
VOCAB_MAPS = ("t2d", "d2t")  # written only when the draft vocabulary is smaller than the target's
# Fields that must agree between a checkpoint and the run resuming from it.
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "vocab_size", "rms_norm_eps",
                "rope_theta", "rope_scaling")
DRAFT_FIELDS = ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids")


@dataclass(frozen=True)
class DraftShape:
    """The `model` section of a draft config file."""

    hidden_size: int  # must equal the target's (the draft reads the target's embeddings)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str = "silu"
    draft_vocab_size: int | None = None  # None: whatever 03 chose (the length of d2t)
    norm_before_residual: bool = True
    norm_before_fc: bool = False  # EAGLE-3.1: RMSNorm over the auxiliary states before fc (common/draft/eagle31.py)
    norm_output: bool = False  # EAGLE-3.1: each draft step hands the next its post-norm state


@dataclass(frozen=True)
class DraftConfigFile:
    path: Path
    model: DraftShape
    training: dict[str, Any]  # checked by common.train.settings.TrainSettings


def _type_ok(value: Any, annotation: Any) -> bool:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(annotation) is list:  # list[str]: a list of such values
        return isinstance(value, list) and all(_type_ok(v, typing.get_args(annotation)[0]) for v in value)
    return isinstance(value, annotation)


def default_config(target: str | Path | None) -> Path:
    """The draft config 04 uses without --draft-config: the tiny one for the built-in miniature (no
    --target), the built-in real target's own (`--target smollm2`), Kimi-K2.5's for any other folder."""
    if target is None:
        return TINY_CONFIG
    return REAL_TARGET_CONFIGS.get(str(target), KIMI_CONFIG)


def checked_fields(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` checked against dataclass `cls`: no unknown key, no missing required key, every
    value of the declared type (ints accepted for floats). Errors name `where` and the key."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise PipelineError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    for name, value in values.items():
        if not _type_ok(value, hints[name]):
            raise PipelineError(f"{where}: {name} = {value!r} is not of type {hints[name]}")
    missing = [n for n, f in known.items() if f.default is MISSING and n not in values]
    if missing:
        raise PipelineError(f"{where}: missing key(s) {missing}")
    return values


def read_config_file(path: str | Path) -> DraftConfigFile:
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"draft config {path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PipelineError(f"draft config {path}: not valid JSON ({e})") from e
    sections = sorted(data) if isinstance(data, dict) else type(data).__name__
    if (not isinstance(data, dict) or set(data) - set(CONFIG_SECTIONS) or not isinstance(data.get("model"), dict)
            or not isinstance(data.get("training", {}), dict)):
        raise PipelineError(f"draft config {path}: expected an object with sections {list(CONFIG_SECTIONS)}, "
                            f"'model' required; found {sections}")
    shape = DraftShape(**checked_fields(DraftShape, data["model"], f"draft config {path} [model]"))
    return DraftConfigFile(path=path, model=shape, training=dict(data.get("training") or {}))


def check_draft_fits(shape: DraftShape, source: Path, info: TargetInfo, d2t_size: int, vocab_dir: Path) -> None:
    """The draft config against the target and the vocabulary maps, naming both sides."""
    if shape.hidden_size != info.hidden_size:
        raise PipelineError(f"draft config {source} has hidden_size {shape.hidden_size}, but target {info.path} "
                            f"has {info.hidden_size} (the draft works in the target's hidden space; "
                            "configs/draft_tiny.json fits the miniature targets, "
                            "configs/draft_smollm2.json --target smollm2, configs/draft_kimi_k25.json Kimi-K2.5)")
    if shape.draft_vocab_size is not None and shape.draft_vocab_size != d2t_size:
        raise PipelineError(f"draft config {source} has draft_vocab_size {shape.draft_vocab_size}, but "
                            f"{vocab_dir}/d2t.pt maps {d2t_size} tokens (re-run 03_build_vocab_map.py "
                            f"--draft-vocab-size {shape.draft_vocab_size})")


def layer_config(shape: DraftShape, info: TargetInfo) -> LlamaConfig:
    """The draft's decoder-layer config: the shape from the file, the rest from the target."""
    text = info.text_config
    config = LlamaConfig(
        vocab_size=info.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim, hidden_act=shape.hidden_act,
        rms_norm_eps=info.rms_norm_eps, max_position_embeddings=text.max_position_embeddings,
        rope_theta=getattr(text, "rope_theta", 10000.0),
        rope_scaling=copy.deepcopy(getattr(text, "rope_scaling", None)),
    )
    config._attn_implementation = patch.ATTENTION_NAME
    return config


def speculator_config(shape: DraftShape, info: TargetInfo, draft_vocab_size: int, layer_ids: list[int],
                      speculative_tokens: int) -> Eagle3SpeculatorConfig:
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config(shape, info),
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=shape.norm_before_residual,
        eagle_aux_hidden_state_layer_ids=list(layer_ids),
        # not fields of 0.3.0's config: kept as its extra fields, written to config.json where vLLM reads them
        norm_before_fc=shape.norm_before_fc, norm_output=shape.norm_output,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=info.path, architectures=[info.architecture]),
        ),
    )


def build_draft(config: Eagle3SpeculatorConfig, t2d: torch.Tensor, d2t: torch.Tensor) -> Eagle3DraftModel:
    """A fresh draft, with the EAGLE-3.1 norms its config asks for; its embeddings and lm_head
    come from the target (needs `patch.apply()`)."""
    model = Eagle3DraftModel(config=config, t2d=t2d, d2t=d2t)
    eagle31.install(model, **eagle31.norms_of(config))
    return model


def config_differences(saved: Eagle3SpeculatorConfig, ours: Eagle3SpeculatorConfig) -> list[str]:
    """`field a (saved) vs b (now)` for every field of the draft's shape that differs."""
    pairs = [(f, getattr(saved.transformer_layer_config, f, None), getattr(ours.transformer_layer_config, f, None))
             for f in LAYER_FIELDS]
    pairs += [(f, getattr(saved, f), getattr(ours, f)) for f in DRAFT_FIELDS]
    pairs += [(f, norms_of(saved)[f], norms_of(ours)[f]) for f in eagle31.NORMS]
    return [f"{name} {a} there, {b} now" for name, a, b in pairs if a != b]


def read_saved_config(folder: str | Path) -> Eagle3SpeculatorConfig:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise PipelineError(f"{folder}: no config.json (not a saved draft)")
    try:
        config = Eagle3SpeculatorConfig.from_pretrained(folder)
    except (ValueError, TypeError, OSError) as e:
        raise PipelineError(f"{folder}/config.json: not an EAGLE-3 speculators config ({e})") from e
    config.transformer_layer_config._attn_implementation = patch.ATTENTION_NAME  # not saved
    return config


def saved_tensor(folder: str | Path, name: str) -> torch.Tensor | None:
    """One tensor of a saved draft or checkpoint (None when absent), read alone."""
    path = Path(folder) / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name) if name in f.keys() else None
    except SafetensorError as e:  # e.g. a file cut short by an interrupted copy
        raise PipelineError(f"{path}: not a readable safetensors file ({e})") from e


def export_draft(checkpoint: str | Path, config: Eagle3SpeculatorConfig, out_dir: str | Path,
                 notes: dict[str, dict] | None = None) -> Path:
    """Write the draft folder from a checkpoint of the library's checkpointer: its weights in
    bf16 minus `verifier_lm_head`, `config` (with dtype bf16), and `notes` as JSON files
    (name -> content; vLLM reads only config.json and the weights). Exporting from the file
    rather than from the model in memory works the same after single-process and FSDP runs."""
    checkpoint = Path(checkpoint)
    state = load_file(str(checkpoint / WEIGHTS_FILE))
    dropped = NOT_EXPORTED + (VOCAB_MAPS if whole_vocabulary(config) else ())
    state = {k: (v.to(EXPORT_DTYPE) if v.is_floating_point() else v).contiguous()
             for k, v in state.items() if k not in dropped}
    config = copy.deepcopy(config)
    config.dtype = EXPORT_DTYPE

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, content in (notes or {}).items():
            write_json(tmp / name, content)

    write_dir(out_dir, fill)
    return Path(out_dir)


def whole_vocabulary(config: Eagle3SpeculatorConfig) -> bool:
    """Whether the draft predicts the target's whole vocabulary (03's identity map): vLLM's
    condition for serving it without `d2t` (`draft_vocab_size == vocab_size`)."""
    return config.draft_vocab_size == config.transformer_layer_config.vocab_size


def identity_maps(vocab_size: int) -> dict[str, torch.Tensor]:
    """`t2d`/`d2t` of a draft vocabulary that is the target's whole one (`common.vocab`'s layout)."""
    return {"t2d": torch.ones(vocab_size, dtype=torch.bool), "d2t": torch.zeros(vocab_size, dtype=torch.long)}


def load_draft(path: str | Path, *, target: str | Path | None = None, trust_remote_code: bool = False,
               device: str | torch.device = "cpu") -> Eagle3DraftModel:
    """An exported draft as an `Eagle3DraftModel` in float32 and eval mode, on `device`.

    Its frozen embedding and `verifier_lm_head` are read from the target named in the config's
    verifier block, or from `target` (when the target has moved). Installs `common.draft.patch`,
    with the draft's forward compiled on CUDA only."""
    path = Path(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise PipelineError(f"draft {path}: no {WEIGHTS_FILE} (export one with 04_train.py)")
    config = read_saved_config(path)
    if target is not None:
        config.speculators_config.verifier.name_or_path = str(Path(target).resolve())
    state = load_file(str(path / WEIGHTS_FILE))
    if not any(k in state for k in VOCAB_MAPS) and whole_vocabulary(config):
        state |= identity_maps(config.draft_vocab_size)
    if not all(k in state for k in VOCAB_MAPS):
        raise PipelineError(f"draft {path}: {WEIGHTS_FILE} holds no t2d/d2t vocabulary maps, which a draft "
                            f"vocabulary of {config.draft_vocab_size:,} of the target's "
                            f"{config.transformer_layer_config.vocab_size:,} ids needs")
    patch.apply(trust_remote_code=trust_remote_code, compile_forward=torch.device(device).type == "cuda")
    model = build_draft(config, state["t2d"], state["d2t"])
    result = model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                                   strict=False)
    missing = [k for k in result.missing_keys if k not in NOT_EXPORTED + ("embed_tokens.weight",)]
    if missing or result.unexpected_keys:
        raise PipelineError(f"draft {path}: weights do not fit its config.json: missing {missing}, "
                            f"unexpected {result.unexpected_keys}")
    return model.to(device).eval()
