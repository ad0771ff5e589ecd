"""INT4 routed experts (common/target/int4_experts.py): written and read with compressed-tensors, kept
packed in memory, exact against the library's own decompression, refused when malformed."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from safetensors.torch import load_file, save_file

from common.draft.patch import find_weight_keys
from common.target.config import TargetError, load_target_info, read_tensors, weight_map
from common.target.int4_experts import (
    PACKED_PARAMS,
    PackedLinear,
    QuantizedTargetError,
    dequantize_packed,
    int4_scheme,
    kimi_quantization_config,
    packed_modules,
    parse_quantization_config,
    quantize_routed_experts,
)
from common.target.model import load_text_model

EXPERT = "language_model.model.layers.1.mlp.experts.3.down_proj"


@pytest.fixture(scope="module")
def int4_model(kimi_target):
    return load_text_model(load_target_info(kimi_target, trust_remote_code=True))


@pytest.fixture(scope="module")
def plain_model(kimi_target):
    """The text model with ordinary Linear layers everywhere, on meta (what the loader starts from)."""
    from accelerate import init_empty_weights
    from transformers import DeepseekV3ForCausalLM

    with init_empty_weights():
        return DeepseekV3ForCausalLM._from_config(load_target_info(kimi_target, trust_remote_code=True).text_config)


def packed_names(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, PackedLinear)}


def packed_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, PackedLinear)
               for t in m.parameters())


def test_packing_is_the_documented_offset_int4_layout():
    """Eight 4-bit values per int32, value k of a word at bits 4k, stored as q + 8: the layout
    Kimi-K2.5 ships (written by compressed-tensors 0.12); checked against that definition."""
    weight = torch.randn(4, 64)
    state, _ = quantize_routed_experts({"model.layers.1.mlp.experts.0.up_proj.weight": weight})
    packed = state["model.layers.1.mlp.experts.0.up_proj.weight_packed"]
    scale = state["model.layers.1.mlp.experts.0.up_proj.weight_scale"]
    assert packed.dtype == torch.int32 and packed.shape == (4, 8) and scale.shape == (4, 2)
    assert scale.dtype == torch.bfloat16
    words = packed.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], dim=-1).view(4, 64) - 8
    assert q.min() >= -8 and q.max() <= 7
    # symmetric: the group's largest magnitude maps to +-7.5 before rounding, so the codes reach +-7/8
    expected = torch.clamp(torch.round(weight / scale.float().repeat_interleave(32, 1)), -8, 7)
    assert torch.equal(q.float(), expected)


def test_only_routed_experts_are_quantized_and_the_config_says_so(plain_model, int4_model):
    state = {"model.layers.0.mlp.gate_proj.weight": torch.randn(128, 64),
             "model.layers.1.mlp.shared_experts.up_proj.weight": torch.randn(32, 64),
             "model.layers.1.self_attn.q_a_proj.weight": torch.randn(32, 64),
             "model.layers.1.mlp.gate.weight": torch.randn(8, 64),
             "lm_head.weight": torch.randn(10, 64),
             "model.layers.1.mlp.experts.0.gate_proj.weight": torch.randn(32, 64)}
    out, config = quantize_routed_experts(state)
    assert set(out) == set(state) - {"model.layers.1.mlp.experts.0.gate_proj.weight"} | {
        f"model.layers.1.mlp.experts.0.gate_proj.{p}" for p in PACKED_PARAMS}
    assert config["format"] == "pack-quantized" and config["quant_method"] == "compressed-tensors"
    weights = config["config_groups"]["group_0"]["weights"]
    assert [weights[k] for k in ("num_bits", "group_size", "symmetric", "strategy")] == [4, 32, True, "group"]
    # The loader, reading that config through the library's matching, picks exactly the routed experts.
    chosen = packed_modules(plain_model, parse_quantization_config(config, "test"), "language_model.")
    assert all(".mlp.experts." in name for name in chosen) and len(chosen) == 7 * 8 * 3
    assert packed_names(int4_model) == set(chosen)


def test_kimi_published_config_is_read(plain_model, int4_model):
    """The config as Kimi-K2.5 publishes it (fields of older compressed-tensors, regex ignore list)."""
    published = {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                      "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                  "group_size": 32, "num_bits": 4, "observer": "minmax",
                                                  "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                                  "type": "int"}}},
        "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    chosen = packed_modules(plain_model, parse_quantization_config(published, "kimi"), "language_model.")
    assert set(chosen) == packed_names(int4_model)


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"format": "float-quantized"}, "format 'float-quantized' is not supported"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(QuantizedTargetError, match=message):
        parse_quantization_config({**kimi_quantization_config(), **change}, "target T")


def test_per_call_decompression_matches_the_library_and_keeps_nothing(int4_model):
    layer = int4_model.model.layers[1].mlp.experts[3].down_proj
    assert isinstance(layer, PackedLinear)
    library = PackedQuantizationCompressor.decompress(
        {"weight_packed": layer.weight_packed, "weight_scale": layer.weight_scale.float(),
         "weight_shape": layer.weight_shape}, int4_scheme())["weight"]
    assert torch.equal(layer.dequantized_weight(torch.float32), library)
    x = torch.randn(5, layer.in_features)
    before = {k: (v.dtype, v.shape) for k, v in layer.state_dict().items()}
    torch.testing.assert_close(layer(x), x @ library.T)
    assert {k: (v.dtype, v.shape) for k, v in layer.state_dict().items()} == before
    assert not [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]  # no cached weight attribute


def test_experts_stay_packed_in_memory_through_forward_passes(kimi_target, int4_model):
    """Resident expert bytes equal the packed bytes on disk, before and after forward passes
    (the library's former CompressedLinear grew them 4.5x on the first forward)."""
    wmap = weight_map(kimi_target)
    on_disk = sum(t.numel() * t.element_size() for t in
                  read_tensors(kimi_target, [k for k in wmap if k.endswith(PACKED_PARAMS)]).values())
    assert packed_bytes(int4_model) == on_disk
    with torch.no_grad():
        int4_model(torch.randint(0, 4000, (2, 30)))
    assert packed_bytes(int4_model) == on_disk
    floats = {name.rpartition(".")[2] for m in int4_model.modules() if isinstance(m, PackedLinear)
              for name, p in m.named_parameters() if p.dtype.is_floating_point}
    assert floats == {"weight_scale"}  # no dequantized weight among them


def test_forward_equals_the_model_with_experts_dequantized_to_fp32(int4_model):
    reference = dequantize_packed(copy.deepcopy(int4_model), torch.float32)
    assert not any(isinstance(m, PackedLinear) for m in reference.modules())
    ids = torch.randint(0, 4000, (2, 40))
    with torch.no_grad():
        ours, ref = int4_model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_patch_reads_unquantized_embeddings_and_lm_head(kimi_target):
    info = load_target_info(kimi_target, trust_remote_code=True)
    embed, head = find_weight_keys(kimi_target, info.weight_prefix)
    tensors = read_tensors(kimi_target, [embed, head])
    assert tensors[head].shape == (info.vocab_size, info.hidden_size) and tensors[head].dtype == torch.bfloat16


def _broken_copy(src: Path, dst: Path, key: str, value: torch.Tensor | None) -> Path:
    """A copy of the target whose tensor `key` is replaced (or, with None, whose shard is deleted)."""
    shutil.copytree(src, dst)
    shard = weight_map(dst)[key]
    if value is None:
        (dst / shard).unlink()
        return dst
    tensors = load_file(dst / shard)
    tensors[key] = value
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case, message", [
    ("scale_shape", rf"{EXPERT}.weight_scale: shape \[64, 3\], expected \[64, 1\]"),
    ("scale_dtype", rf"{EXPERT}.weight_scale: dtype torch.int32"),
    ("packed_dtype", rf"{EXPERT}.weight_packed: dtype torch.int64"),
    ("weight_shape", rf"{EXPERT}.weight_shape: weight_shape \[64, 64\]"),
    ("group_size", rf"{EXPERT}.weight_scale: shape \[64, 2\], expected \[64, 1\].*group size of 16, "
                   "the quantization_config says 32"),
    ("missing_shard", r"shard model-0000\d-of-00004.safetensors named in model.safetensors.index.json is missing "
                      r"\(it holds "),
])
def test_malformed_int4_checkpoints_name_the_tensor(kimi_target, tmp_path, case, message):
    param = {"weight_shape": "weight_shape", "packed_dtype": "weight_packed"}.get(case, "weight_scale")
    key = f"{EXPERT}.{param}"
    original = read_tensors(kimi_target, [key])[key]
    value = {"scale_shape": lambda: torch.ones(64, 3, dtype=torch.bfloat16),
             "scale_dtype": lambda: original.to(torch.int32),
             "packed_dtype": lambda: original.to(torch.int64),
             "weight_shape": lambda: torch.tensor([64, 64]),
             "group_size": lambda: torch.ones(64, 2, dtype=torch.bfloat16),
             "missing_shard": lambda: None}[case]()
    broken = _broken_copy(kimi_target, tmp_path / case, key, value)
    with pytest.raises(TargetError, match=message):
        load_text_model(load_target_info(broken, trust_remote_code=True))


def test_config_and_checkpoint_that_disagree_are_refused(kimi_target, tmp_path):
    """A checkpoint whose experts are packed but whose config lost its quantization_config."""
    broken = tmp_path / "no_config"
    shutil.copytree(kimi_target, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError, match=r"missing \['model.layers.1.mlp.experts.0.down_proj.weight'.*"
                                          r"unexpected \['model.layers.1.mlp.experts.0.down_proj.weight_packed'.*"
                                          r"compressed-tensors packed weights .*missing from config.json"):
        load_text_model(load_target_info(broken, trust_remote_code=True))


def test_bf16_variant_has_the_same_weights_before_quantization(kimi_target):
    from common.miniatures.targets import ensure_target

    bf16 = ensure_target("kimi-bf16")
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())["text_config"]
    key = f"{EXPERT}.weight"
    weight = read_tensors(bf16, [key])[key]
    requantized, _ = quantize_routed_experts({key: weight})
    stored = read_tensors(kimi_target, [f"{EXPERT}.{p}" for p in PACKED_PARAMS])
    for p in PACKED_PARAMS:
        assert torch.equal(requantized[f"{EXPERT}.{p}"], stored[f"{EXPERT}.{p}"])
