"""INT4 routed experts as Kimi-K2.5 stores them, kept packed in memory.

Kimi-K2.5's routed experts (1.015e12 of its parameters) are compressed-tensors
`pack-quantized` INT4: per expert matrix `weight_packed` (int32, eight 4-bit values each,
offset by 8), `weight_scale` (bf16, one per group of 32 inputs) and `weight_shape`, with the
`quantization_config` inside `text_config`. Everything else (attention, shared experts, the
dense MLP of layer 0, lm_head, vision tower, projector) is bf16, named in the config's `ignore`.

Writing (the miniature) and reading both go through the compressed-tensors library: its
`PackedQuantizationCompressor` packs, its `unpack_from_int32`/`dequantize` unpack, its
`is_match` decides which modules the config quantizes. What the library does not give us is a
module that *stays* packed: its old `CompressedLinear` decompressed on the first forward and
kept both copies (4.5x the expert bytes; about 2.6 TB on Kimi-K2.5), and 0.20 removed it. So
`PackedLinear` holds only the three packed tensors and dequantizes its weight inside each call,
dropping it when the call returns: resident memory stays the packed size on disk.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils.match import is_match

from common.target.config import TargetError

PACKED_PARAMS = ("weight_packed", "weight_scale", "weight_shape")
GROUP_SIZE = 32  # Kimi-K2.5's group size
SCALE_DTYPE = torch.bfloat16  # Kimi-K2.5 stores its scales in bf16
# A routed expert's projection, with or without the `language_model.` prefix.
ROUTED_EXPERT = re.compile(r"(^|.*\.)mlp\.experts\.\d+\.(gate|up|down)_proj$")
# Kimi's kind of ignore list: everything but the routed experts stays unquantized.
KIMI_IGNORE = ["lm_head", "re:.*lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]


class QuantizedTargetError(TargetError):
    """A quantized checkpoint that does not match its own quantization_config; names the tensor."""


def int4_scheme(group_size: int = GROUP_SIZE) -> QuantizationScheme:
    """Kimi-K2.5's scheme: symmetric INT4 weights in groups of `group_size`, activations unquantized."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def kimi_quantization_config(group_size: int = GROUP_SIZE) -> dict:
    """The `text_config.quantization_config` of a checkpoint stored like Kimi-K2.5."""
    config = QuantizationConfig(config_groups={"group_0": int4_scheme(group_size)}, format="pack-quantized",
                                quantization_status="compressed", ignore=list(KIMI_IGNORE))
    return config.model_dump(mode="json")


def quantize_routed_experts(state: dict[str, torch.Tensor], group_size: int = GROUP_SIZE
                            ) -> tuple[dict[str, torch.Tensor], dict]:
    """(state with every routed expert's `.weight` replaced by its packed INT4 tensors, the
    quantization_config to put in `text_config`). Scales come from each group's absolute maximum
    (the library's min-max observer, symmetric), packing from the library's compressor."""
    scheme = int4_scheme(group_size)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module = key.removesuffix(".weight")
        if key == module or not ROUTED_EXPERT.match(module):
            out[key] = tensor
            continue
        rows, cols = tensor.shape
        if cols % group_size:
            raise ValueError(f"{key}: {cols} inputs are not a multiple of the group size {group_size}")
        groups = tensor.float().view(rows, cols // group_size, group_size)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        module_state = {"weight": tensor.float(), "weight_scale": scale.to(SCALE_DTYPE)}
        packed = PackedQuantizationCompressor.compress(module_state, scheme)
        out.update({f"{module}.{name}": packed[name] for name in PACKED_PARAMS})
    return out, kimi_quantization_config(group_size)


def parse_quantization_config(raw: dict | None, where: str) -> QuantizationConfig | None:
    """The checkpoint's quantization_config, refused unless it is the kind this module runs:
    compressed-tensors, pack-quantized, symmetric integer weights in groups, no activation
    quantization. `where` names the config in errors."""
    if not raw:
        return None
    if raw.get("quant_method") != "compressed-tensors":
        raise QuantizedTargetError(f"{where}: quantization_config quant_method {raw.get('quant_method')!r} "
                                   "is not supported (only compressed-tensors)")
    try:
        config = QuantizationConfig.model_validate(raw)
    except ValueError as e:
        raise QuantizedTargetError(f"{where}: cannot read quantization_config: {e}") from e
    if config.format != "pack-quantized":
        raise QuantizedTargetError(f"{where}: quantization_config format {config.format!r} is not supported "
                                   "(only pack-quantized, as Kimi-K2.5)")
    for name, scheme in config.config_groups.items():
        w = scheme.weights
        if (w is None or w.type != "int" or not w.symmetric or w.strategy != "group" or not w.group_size
                or scheme.input_activations is not None):
            raise QuantizedTargetError(f"{where}: quantization_config group {name} is not symmetric integer "
                                       f"group-wise weight-only quantization: {scheme.model_dump(mode='json')}")
    return config


def packed_modules(model: torch.nn.Module, config: QuantizationConfig, prefix: str = ""
                   ) -> dict[str, QuantizationScheme]:
    """Module name -> scheme for every Linear the config quantizes. A name is tried both as
    the text model sees it and with the checkpoint's `prefix` (`language_model.`), since a
    config's targets and ignore list may be written either way."""
    chosen = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        forms = (name, prefix + name) if prefix else (name,)
        for scheme in config.config_groups.values():
            targeted = any(is_match(n, module, scheme.targets) for n in forms)
            ignored = any(is_match(n, module, ign) for n in forms for ign in config.ignore or [])
            if targeted and not ignored:
                chosen[name] = scheme
                break
    return chosen


class PackedLinear(torch.nn.Module):
    """A bias-free Linear whose weight stays compressed-tensors pack-quantized. Each call
    dequantizes the weight in the input's dtype, multiplies, and lets it go: nothing but the
    packed tensors is ever kept (unlike the library's former `CompressedLinear`)."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantizationScheme) -> None:
        super().__init__()
        args = scheme.weights
        if in_features % args.group_size:
            raise ValueError(f"{in_features} inputs are not a multiple of the group size {args.group_size}")
        self.in_features, self.out_features, self.args = in_features, out_features, args
        no_grad = {"requires_grad": False}
        # Parameters rather than buffers, so that accelerate's empty-weight init keeps them on meta.
        self.weight_packed = torch.nn.Parameter(torch.empty(out_features, math.ceil(in_features * args.num_bits / 32),
                                                            dtype=torch.int32), **no_grad)
        self.weight_scale = torch.nn.Parameter(torch.empty(out_features, in_features // args.group_size,
                                                           dtype=SCALE_DTYPE), **no_grad)
        self.weight_shape = torch.nn.Parameter(torch.tensor([out_features, in_features]), **no_grad)

    @classmethod
    def like(cls, linear: torch.nn.Linear, scheme: QuantizationScheme) -> PackedLinear:
        if linear.bias is not None:
            raise ValueError("pack-quantized projections with a bias are not supported")
        return cls(linear.in_features, linear.out_features, scheme)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`, computed from the packed tensors (not stored)."""
        ints = unpack_from_int32(self.weight_packed, self.args.num_bits, (self.out_features, self.in_features))
        return dequantize(ints, self.weight_scale.to(dtype), args=self.args, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.args.num_bits} " \
               f"group {self.args.group_size}, packed"


def replace_with_packed(model: torch.nn.Module, schemes: dict[str, QuantizationScheme]) -> None:
    """Swap each named Linear for a `PackedLinear` of the same shape (on meta under empty-weight init)."""
    for name, scheme in schemes.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, PackedLinear.like(getattr(parent, child), scheme))


def check_packed_tensor(key: str, value: torch.Tensor, module: PackedLinear, param: str) -> None:
    """Refuse a packed tensor whose shape or dtype does not fit the config and the layer,
    naming the checkpoint key: a wrong scale shape or group size would otherwise dequantize
    into silent garbage (or crash deep inside a forward pass)."""
    expected = getattr(module, param)
    group = module.args.group_size
    if param == "weight_shape":
        if value.tolist() != [module.out_features, module.in_features]:
            raise QuantizedTargetError(f"{key}: weight_shape {value.tolist()}, but the layer is "
                                       f"[{module.out_features}, {module.in_features}]")
        return
    if param == "weight_packed" and value.dtype != torch.int32:
        raise QuantizedTargetError(f"{key}: dtype {value.dtype}, expected int32 (eight 4-bit values each)")
    if param == "weight_scale" and not value.dtype.is_floating_point:
        raise QuantizedTargetError(f"{key}: dtype {value.dtype}, expected a floating-point scale")
    if tuple(value.shape) != tuple(expected.shape):
        hint = ""
        if param == "weight_scale" and value.ndim == 2 and value.shape[1]:
            hint = (f": {value.shape[1]} groups per row means a group size of "
                    f"{module.in_features / value.shape[1]:g}, the quantization_config says {group}")
        raise QuantizedTargetError(f"{key}: shape {list(value.shape)}, expected {list(expected.shape)} "
                                   f"(int{module.args.num_bits}, group size {group}, layer "
                                   f"{module.out_features}x{module.in_features}){hint}")


def dequantize_packed(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Replace every `PackedLinear` of `model` by a plain Linear holding its dequantized weight
    (in place; returns the model). The reference a packed model's outputs are checked against."""
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False,
                                     device=module.weight_packed.device, dtype=dtype)
            linear.weight.data = module.dequantized_weight(dtype)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, linear)
    return model
