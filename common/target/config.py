"""Reading a target checkpoint's facts: its text config, its weight index and single tensors.

Kimi-K2.5 nests its text model: `config.json` is a multimodal wrapper (`model_type kimi_k25`,
read through remote code) with the DeepSeek-V3 text config under `text_config`, and the text
weights live under `language_model.` next to `vision_tower.*`/`mm_projector.*`. A flat causal
LM has its fields at the top level and weights under `model.*`/`lm_head.*`. Everything in the
pipeline that reads the target goes through this package, so both shapes work everywhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from common.atomic import read_json
from common.errors import PipelineError

NESTED_PREFIX = "language_model."
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
REQUIRED_TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")
# transformers class of a nested text config by its model_type, where the config names none
TEXT_ARCHITECTURES = {"kimi_k2": "DeepseekV3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


class TargetError(PipelineError, ValueError):
    """A target folder that cannot be used; the message names the folder and the cause."""


@dataclass(frozen=True)
class TargetInfo:
    """What the pipeline needs to know about a target (from its config only)."""

    path: str
    architecture: str  # architecture of the whole checkpoint, e.g. KimiK25ForConditionalGeneration
    text_architecture: str  # architecture of the text model, e.g. DeepseekV3ForCausalLM
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    pad_token_id: int | None
    rms_norm_eps: float
    weight_prefix: str  # "language_model." for a nested checkpoint, "" for a flat one
    text_config: PretrainedConfig
    quantization_config: dict | None = None  # compressed-tensors config (Kimi-K2.5: INT4 routed experts)
    # From generation_config.json, read with the config: the ids that end a generation (Kimi-K2.5 ends
    # a turn with `<|im_end|>`, which only the generation config names) and the sampling defaults
    # (without a temperature there, or with do_sample false, decoding is greedy: transformers' default).
    stop_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def nested(self) -> bool:
        return bool(self.weight_prefix)

    def default_layer_ids(self) -> list[int]:
        """EAGLE-3's auxiliary layers `[2, N//2, N-3]` in the vLLM convention (see docs/FILES.md)."""
        n = self.num_layers
        return [2, n // 2, n - 3]


def choose_layer_ids(given: list[int] | None, info: TargetInfo) -> list[int]:
    """`--layer-ids`, or EAGLE-3's default auxiliary layers of the target, validated; a target too
    shallow for the defaults is told so (the user typed no ids)."""
    if given:
        return validate_layer_ids(given, info.num_layers)
    defaults = info.default_layer_ids()
    try:
        return validate_layer_ids(defaults, info.num_layers)
    except PipelineError as e:
        raise PipelineError(f"target {info.path}: EAGLE-3's default auxiliary layers [2, N//2, N-3] are {defaults} "
                            f"for its {info.num_layers} layers, not three distinct ids in 1..{info.num_layers - 1}; "
                            "pass --layer-ids with three") from e


def validate_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Three distinct auxiliary ids in 1..N-1 (N is the final state's place, 0 the embeddings)."""
    valid = f"three distinct ids in 1..{num_layers - 1} for a target with {num_layers} layers"
    if len(layer_ids) != 3 or len(set(layer_ids)) != 3:
        raise PipelineError(f"--layer-ids {' '.join(map(str, layer_ids))}: expected {valid}")
    bad = [i for i in layer_ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise PipelineError(f"--layer-ids {' '.join(map(str, layer_ids))}: {bad} out of range; expected {valid}")
    return list(layer_ids)


def _check_folder(path: Path) -> None:
    if not path.is_dir():
        raise TargetError(f"target {path}: no such folder")
    if not (path / "config.json").is_file():
        raise TargetError(f"target {path}: no config.json (is this a Hugging Face checkpoint folder?)")


def load_text_config(path: str | Path, trust_remote_code: bool = False) -> tuple[PretrainedConfig, PretrainedConfig]:
    """(top-level config, text config) of a target; they are the same object for a flat model."""
    path = Path(path)
    _check_folder(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise TargetError(f"target {path}: its config is remote code; pass --trust-remote-code") from e
        raise TargetError(f"target {path}: cannot read config.json: {e}") from e
    except (OSError, json.JSONDecodeError) as e:
        raise TargetError(f"target {path}: cannot read config.json: {e}") from e
    text = getattr(config, "text_config", None) or config
    missing = [f for f in REQUIRED_TEXT_FIELDS if getattr(text, f, None) is None]
    if missing:
        raise TargetError(f"target {path}: config ({config.model_type}) is not a causal language model: "
                          f"no {', '.join(missing)} at the top level or under text_config")
    return config, text


def load_target_info(path: str | Path, trust_remote_code: bool = False) -> TargetInfo:
    """Everything the stages need to know about the target at `path`, read once from its config
    files (no weights)."""
    config, text = load_text_config(path, trust_remote_code)
    generation = _generation_config(Path(path))
    sampled = generation.get("do_sample") is not False and generation.get("temperature") is not None
    nested = text is not config
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    text_archs = getattr(text, "architectures", None) or archs
    if nested and not getattr(text, "architectures", None):
        text_archs = [_text_architecture(path, text)]
    pad = getattr(text, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    return TargetInfo(
        path=str(Path(path).resolve()),
        architecture=archs[0],
        text_architecture=text_archs[0],
        model_type=config.model_type,
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size),
        pad_token_id=pad,
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        weight_prefix=NESTED_PREFIX if nested else "",
        text_config=text,
        quantization_config=_quantization_dict(text) or _quantization_dict(config),
        stop_ids=frozenset(_ids(getattr(text, "eos_token_id", None)) | _ids(generation.get("eos_token_id"))),
        temperature=float(generation["temperature"]) if sampled else 0.0,
        top_p=float(generation.get("top_p", 1.0)) if sampled else 1.0,
    )


def _generation_config(path: Path) -> dict:
    file = path / GENERATION_CONFIG
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TargetError(f"target {path}: cannot read {GENERATION_CONFIG}: {e}") from e
    if not isinstance(data, dict):
        raise TargetError(f"target {path}: {GENERATION_CONFIG} is not a JSON object")
    return data


def _ids(value: int | list[int] | None) -> set[int]:
    return set() if value is None else {value} if isinstance(value, int) else set(value)


def _text_architecture(path: str | Path, text: PretrainedConfig) -> str:
    """The transformers class of a nested text config that names none (Kimi-K2.5's `kimi_k2` is a
    DeepSeek-V3 config that transformers knows under its own name)."""
    name = TEXT_ARCHITECTURES.get(text.model_type)
    if name is None:
        raise TargetError(f"target {path}: text_config ({text.model_type}) names no architectures and none is "
                          f"known for it (known: {', '.join(sorted(TEXT_ARCHITECTURES))})")
    return name


def _quantization_dict(config: PretrainedConfig) -> dict | None:
    raw = getattr(config, "quantization_config", None)
    return raw.to_dict() if hasattr(raw, "to_dict") else raw


def target_digest(path: str | Path) -> str:
    """What a target is, not where it lies (16 hex characters): a digest of its `config.json` and
    its weight index (for a single weights file, its safetensors header: names, dtypes, shapes,
    offsets). A folder moved to another disk or copied keeps it; another checkpoint of other
    shapes or settings has another. (Two checkpoints alike in every shape, e.g. fine-tunes of one
    base, share it: telling them apart would mean reading the weights.)"""
    path, digest = Path(path), hashlib.sha256()
    for name in ("config.json", INDEX_FILE):
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    if not (path / INDEX_FILE).is_file() and (path / SINGLE_FILE).is_file():
        with (path / SINGLE_FILE).open("rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_size, 100 << 20)))
    return digest.hexdigest()[:16]


def weight_map(path: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single safetensors file."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        index = read_json(path / INDEX_FILE)  # one cut short is a one-line error naming it
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise TargetError(f"target {path}: {INDEX_FILE} has no 'weight_map' object (copy the file again)")
        return index["weight_map"]
    if (path / SINGLE_FILE).is_file():
        try:
            with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except SafetensorError as e:
            raise TargetError(f"target {path}: {SINGLE_FILE} is not a readable safetensors file ({e}); "
                              "copy it again") from e
    raise TargetError(f"target {path}: no weights ({INDEX_FILE} or {SINGLE_FILE} not found)")


def read_tensors(path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors, opening only the shards that hold them."""
    path = Path(path)
    wmap = weight_map(path)
    by_shard: dict[str, list[str]] = {}
    for name in names:
        if name in wmap:
            by_shard.setdefault(wmap[name], []).append(name)
    out = {}
    for shard, keys in by_shard.items():
        if not (path / shard).is_file():
            more = f" and {len(keys) - 1:,} more" if len(keys) > 1 else ""
            raise TargetError(f"target {path}: shard {shard} named in {INDEX_FILE} is missing "
                              f"(it holds {keys[0]}{more})")
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in keys})
    return out
