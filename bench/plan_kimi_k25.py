"""Computed, not measured: what Kimi-K2.5 needs per GPU under `--device-map auto`.

Builds Kimi-K2.5's text model at full size on the meta device (no memory, no download: the
shapes of its published text_config, INT4 routed experts as `PackedLinear`), takes the bytes of
every block as the loader will hold them, and runs the same planner 02 and 05 use, for a given
number of GPUs and budget per GPU. It prints the totals (routed experts packed, their scales,
everything else in bf16), the activation headroom for `--batch-tokens`, and the plan, or the
refusal the scripts would print. Building the 61 layers x 384 experts on meta takes a few minutes.

Usage:
    python bench/plan_kimi_k25.py                                   # 8 x 141 GB (H200), 16384 tokens
    python bench/plan_kimi_k25.py --gpus 8 --max-memory 96GB        # an 8 x 96 GB host
    python bench/plan_kimi_k25.py --gpus 1 --max-memory 141GB       # one H200: refused
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.fixtures.targets import KIMI_TEXT_CONFIG  # noqa: E402
from common.target.device_plan import (  # noqa: E402
    DevicePlanError,
    activation_headroom,
    block_sizes,
    parse_size,
    plan_device_map,
)
from common.target.int4_experts import (  # noqa: E402
    PackedLinear,
    kimi_quantization_config,
    packed_modules,
    parse_quantization_config,
    replace_with_packed,
)

# Kimi-K2.5's text_config where it differs from the miniature's (its published config.json).
KIMI_K25_SHAPE = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                  "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
                  "n_routed_experts": 384, "num_experts_per_tok": 8, "q_lora_rank": 1536,
                  "qk_nope_head_dim": 128, "v_head_dim": 128}


def kimi_meta_model() -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**{**KIMI_TEXT_CONFIG, **KIMI_K25_SHAPE})
    quantization = parse_quantization_config(kimi_quantization_config(), "Kimi-K2.5")
    with init_empty_weights():
        model = DeepseekV3ForCausalLM._from_config(config, dtype=torch.bfloat16)
        replace_with_packed(model, packed_modules(model, quantization, "language_model."))
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--max-memory", default="141GB", help="budget per GPU (default: %(default)s, an H200)")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    args = parser.parse_args()

    start = time.perf_counter()
    model = kimi_meta_model()
    blocks = block_sizes(model, torch.bfloat16)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    words = sum(m.weight_packed.numel() * 4 for m in packed)
    scales = sum(m.weight_scale.numel() * 2 for m in packed)
    total = sum(size for _, size in blocks)
    params = sum(m.in_features * m.out_features for m in packed)
    print(f"Kimi-K2.5 text model (built on meta in {time.perf_counter() - start:.0f}s): {len(packed):,} packed expert "
          f"matrices, {params:.4g} parameters: {words / 1e9:,.1f} GB packed + {scales / 1e9:,.1f} GB scales "
          f"(bf16 would be {params * 2 / 1e12:.3g} TB); everything else bf16 {(total - words - scales) / 1e9:,.1f} GB; "
          f"total {total / 1e9:,.1f} GB; largest block {max(s for _, s in blocks) / 1e9:.2f} GB")
    headroom = activation_headroom(model.config, args.batch_tokens, torch.bfloat16)
    budgets = dict.fromkeys((f"cuda:{i}" for i in range(args.gpus)), parse_size(args.max_memory))
    print(f"{args.gpus} GPU(s) of {args.max_memory}, --batch-tokens {args.batch_tokens:,}: "
          f"activation headroom {headroom / 1e9:.2f} GB per GPU")
    try:
        plan = plan_device_map(blocks, budgets, headroom)
    except DevicePlanError as e:
        print(f"refused: {e}")
        return 0
    for device, used in plan.used.items():
        print(f"  {device}: {used / 1e9:,.1f} GB weights + {headroom / 1e9:.1f} GB activations "
              f"= {(used + headroom) / 1e9:,.1f} GB of {budgets[device] / 1e9:,.0f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
