"""Building a target's text model: from the checkpoint's config on the meta device, filled tensor
by tensor (nested or flat, INT4 experts kept packed), on one device or planned over the GPUs.

`common/target/config.py` reads the facts this module builds from.
"""

from __future__ import annotations

import torch
import transformers
from accelerate import dispatch_model, init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from transformers import AutoModelForCausalLM

from common.errors import PipelineError
from common.target.config import TargetError, TargetInfo, read_tensors, weight_map
from common.target.device_plan import activation_headroom, block_sizes, gpu_budgets, plan_device_map
from common.target.int4_experts import (
    PackedLinear,
    QuantizedTargetError,
    check_packed_tensor,
    packed_modules,
    parse_quantization_config,
    replace_with_packed,
)


def load_text_model(info: TargetInfo, dtype: torch.dtype = torch.float32, device: str | None = "cpu",
                    device_map: str | dict | None = None, max_memory: str | None = None,
                    batch_tokens: int = 2048, logits: bool = False) -> torch.nn.Module:
    """The target's text model as a transformers causal LM, in eval mode; any failure to build it
    names the target folder (see `_build_text_model` for how it is built)."""
    try:
        return _build_text_model(info, dtype=dtype, device=device, device_map=device_map, max_memory=max_memory,
                                 batch_tokens=batch_tokens, logits=logits)
    except PipelineError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, accelerate and torch raise many types here
        raise TargetError(f"target {info.path}: cannot load its weights: {type(e).__name__}: {e}") from e


def _build_text_model(info: TargetInfo, dtype: torch.dtype = torch.float32, device: str | None = "cpu",
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
    the visible GPUs with `common.target.device_plan` (budgets `max_memory`, activation headroom for
    `batch_tokens`, with `logits` when the lm_head runs), or refuses."""
    weight_map(info.path)  # fail early, naming the folder, when there are no weights
    if not info.nested and not info.quantization_config and device_map is None:
        model = AutoModelForCausalLM.from_pretrained(info.path, dtype=dtype)
        return (model.to(device) if device else model).eval()
    model = empty_text_model(info, dtype)
    if device_map == "auto":
        headroom = activation_headroom(info.text_config, batch_tokens, dtype, logits=logits)
        plan = plan_device_map(block_sizes(model, dtype), gpu_budgets(max_memory), headroom)
        print(f"device map: {plan.summary()}")
        device_map = plan.placement
    return _fill_model(model, info, dtype, device or "cpu", device_map).eval()


def empty_text_model(info: TargetInfo, dtype: torch.dtype) -> torch.nn.Module:
    """The text model on the meta device, its pack-quantized layers as `PackedLinear`s."""
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


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(base model without lm_head, its decoder layers) of a transformers causal LM."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TargetError(f"{type(model).__name__}: no model.layers to hook; this architecture is not supported")
    return base, layers
