"""Reading a target checkpoint: its text config, single weight tensors, and its text model.

Kimi-K2.5 nests its text model: `config.json` is a multimodal wrapper (`model_type kimi_k25`,
read through remote code) with the DeepSeek-V3 text config under `text_config`, and the text
weights live under `language_model.` next to `vision_tower.*`/`mm_projector.*`. A flat causal
LM has its fields at the top level and weights under `model.*`/`lm_head.*`. Everything in the
pipeline that touches the target goes through this module, so both shapes work everywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from common.errors import PipelineError

NESTED_PREFIX = "language_model."
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
REQUIRED_TEXT_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")
# --dtype of the stages that run the target (00, 02, 05)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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

    @property
    def nested(self) -> bool:
        return bool(self.weight_prefix)

    def default_layer_ids(self) -> list[int]:
        """EAGLE-3's auxiliary layers `[2, N//2, N-3]` in the vLLM convention (see docs/FILES.md)."""
        n = self.num_layers
        return [2, n // 2, n - 3]


def _check_folder(path: Path) -> None:
    if not path.is_dir():
        raise TargetError(f"target {path}: no such folder")
    if not (path / "config.json").is_file():
        raise TargetError(f"target {path}: no config.json (is this a Hugging Face checkpoint folder?)")


def load_text_config(path: str | Path, trust_remote_code: bool = True) -> tuple[PretrainedConfig, PretrainedConfig]:
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


def load_target_info(path: str | Path, trust_remote_code: bool = True) -> TargetInfo:
    config, text = load_text_config(path, trust_remote_code)
    nested = text is not config
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    text_archs = getattr(text, "architectures", None) or archs
    if nested and not getattr(text, "architectures", None):
        text_archs = ["DeepseekV3ForCausalLM"]
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
    )


def _quantization_dict(config: PretrainedConfig) -> dict | None:
    raw = getattr(config, "quantization_config", None)
    return raw.to_dict() if hasattr(raw, "to_dict") else raw


def weight_map(path: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or the single safetensors file."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        return json.loads((path / INDEX_FILE).read_text())["weight_map"]
    if (path / SINGLE_FILE).is_file():
        with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
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


def load_text_model(info: TargetInfo, dtype: torch.dtype = torch.float32, device: str | None = "cpu",
                    device_map: str | dict | None = None, max_memory: str | None = None,
                    batch_tokens: int = 2048, logits: bool = False) -> torch.nn.Module:
    """The target's text model as a transformers causal LM, in eval mode.

    A plain flat checkpoint on one device loads through `from_pretrained`. Anything else (a
    nested checkpoint, compressed-tensors weights, `device_map="auto"`) is built from the text
    config on the meta device and filled tensor by tensor: for a nested one only the
    `language_model.*` tensors are read, prefix stripped, so the vision tower is never built
    (transformers' `key_mapping` cannot do this: it decides whether the checkpoint is a base
    model from the unmapped keys and refuses). Pack-quantized layers (Kimi-K2.5's routed
    experts) become `PackedLinear`s and stay packed. `device_map="auto"` spreads the model over
    the visible GPUs with `common.device_plan` (budgets `max_memory`, activation headroom for
    `batch_tokens`, with `logits` when the lm_head runs), or refuses."""
    from transformers import AutoModelForCausalLM

    weight_map(info.path)  # fail early, naming the folder, when there are no weights
    if not info.nested and not info.quantization_config and device_map is None:
        model = AutoModelForCausalLM.from_pretrained(info.path, dtype=dtype)
        return (model.to(device) if device else model).eval()
    model = empty_text_model(info, dtype)
    if device_map == "auto":
        from common.device_plan import activation_headroom, block_sizes, gpu_budgets, plan_device_map

        headroom = activation_headroom(info.text_config, batch_tokens, dtype, logits=logits)
        plan = plan_device_map(block_sizes(model, dtype), gpu_budgets(max_memory), headroom)
        print(f"device map: {plan.summary()}")
        device_map = plan.placement
    return _fill_model(model, info, dtype, device or "cpu", device_map).eval()


def empty_text_model(info: TargetInfo, dtype: torch.dtype) -> torch.nn.Module:
    """The text model on the meta device, its pack-quantized layers as `PackedLinear`s."""
    import transformers
    from accelerate import init_empty_weights

    from common.int4_experts import packed_modules, parse_quantization_config, replace_with_packed

    cls = getattr(transformers, info.text_architecture, None)
    if cls is None:
        raise TargetError(f"target {info.path}: text architecture {info.text_architecture} is not in transformers")
    quantization = parse_quantization_config(info.quantization_config, f"target {info.path}")
    with init_empty_weights():  # parameters on meta, buffers (rotary tables) real
        model = cls._from_config(info.text_config, dtype=dtype)
        if quantization is not None:
            replace_with_packed(model, packed_modules(model, quantization, info.weight_prefix))
    return model


def _fill_model(model: torch.nn.Module, info: TargetInfo, dtype: torch.dtype, device: str,
                device_map: dict | None) -> torch.nn.Module:
    from accelerate import dispatch_model
    from accelerate.utils import set_module_tensor_to_device

    from common.int4_experts import PackedLinear, QuantizedTargetError, check_packed_tensor

    placement = device_map if isinstance(device_map, dict) else {"": device}
    expected = model.state_dict()
    names = [k for k in weight_map(info.path) if k.startswith(info.weight_prefix)]
    stripped = {k[len(info.weight_prefix):]: k for k in names}
    tied = {"lm_head.weight"} if getattr(info.text_config, "tie_word_embeddings", False) else set()
    unexpected = sorted(set(stripped) - set(expected))
    missing = sorted(set(expected) - set(stripped) - tied)
    if unexpected or missing:
        hint = ""
        if any(k.endswith(".weight_packed") for k in unexpected):
            hint = ("; the checkpoint holds compressed-tensors packed weights that its quantization_config "
                    + ("does not name" if info.quantization_config else "(missing from config.json) would describe"))
        raise TargetError(f"target {info.path}: weights do not fit {info.text_architecture}"
                          f"{' with its quantization_config' if info.quantization_config else ''}: "
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}{hint}")
    for shard_names in _by_shard(info.path, names).values():
        for key, tensor in read_tensors(info.path, shard_names).items():
            name = key[len(info.weight_prefix):]
            module_name, _, param = name.rpartition(".")
            module = model.get_submodule(module_name)
            if isinstance(module, PackedLinear):  # kept as stored: int32 words, bf16 scales
                try:
                    check_packed_tensor(key, tensor, module, param)
                except QuantizedTargetError as e:
                    raise TargetError(f"target {info.path}: {e}") from e
                set_module_tensor_to_device(model, name, _device_for(name, placement), value=tensor,
                                            dtype=tensor.dtype)
                continue
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise TargetError(f"target {info.path}: {key} has shape {list(tensor.shape)}, "
                                  f"{info.text_architecture} expects {list(expected[name].shape)}")
            set_module_tensor_to_device(model, name, _device_for(name, placement), value=tensor, dtype=dtype)
    if tied:
        model.tie_weights()
    if isinstance(device_map, dict) and len(set(device_map.values())) > 1:
        return dispatch_model(model, device_map=device_map)
    return model.to(next(iter(placement.values())))


def _by_shard(path: str, names: list[str]) -> dict[str, list[str]]:
    wmap, groups = weight_map(path), {}
    for name in names:
        groups.setdefault(wmap[name], []).append(name)
    return groups


def _device_for(name: str, placement: dict) -> str | int:
    """The device of the longest device-map prefix that covers parameter `name`."""
    best = max((p for p in placement if p == "" or name == p or name.startswith(p + ".")), key=len)
    return placement[best]
