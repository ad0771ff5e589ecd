"""Computed, not measured: what Kimi-K2.5 needs per GPU under `--device-map auto`.

Builds Kimi-K2.5's text model at full size on the meta device (no memory, no download: the
shapes of its published text_config, INT4 routed experts as `PackedLinear`), takes the bytes of
every block as the loader will hold them, and runs the same planner 02 and 05 use, for a given
number of GPUs and budget per GPU. It prints the totals (routed experts packed, their scales,
everything else in bf16), the activation headroom for `--batch-tokens`, and the plan, or the
refusal the scripts would print. Building the 61 layers x 384 experts on meta takes a few minutes.

With `--online`, also the plan of 04 --online on one host (common/online/host_plan.py): per host type
(8 x H200, 8 x 96 GB RTX PRO 6000 Blackwell), vLLM's share of each GPU as a prefill-only hidden-state
server (TP over the host's GPUs: the weights each rank holds, computed from the meta model, and an
engine sized for prefill; the vLLM flags and the --gpu-memory-utilization they come to), the training
layout that fits beside it with 10% of each GPU spare (the largest pack, --grad-accum making up 8,192
tokens per rank per step, --activation-checkpointing where needed; the trainer's peak per rank from
common/train/memory_plan.py, term by term), or what to change when none does, and the tokens/s and
hours to expect for 500K x 2,048 tokens x 3 epochs at the stated utilisations (estimates, not
measurements: bench/gpu_train_full_shape.py measures the draft's step, bench/bench_04_memory.py the
memory model against a measured step).

Usage:
    python scripts/plan_kimi_k25.py                                   # 8 x 141 GB (H200), 16384 tokens
    python scripts/plan_kimi_k25.py --gpus 8 --max-memory 96GB        # an 8 x 96 GB host
    python scripts/plan_kimi_k25.py --gpus 1 --max-memory 141GB       # one H200: refused
    python scripts/plan_kimi_k25.py --online [--prefetch 2]                # and 04 --online's layout
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from common.miniatures.targets import KIMI_TEXT_CONFIG
from common.online.host_plan import (
    CARDS,
    MIN_TOKENS_PER_STEP,
    assumptions,
    describe_host,
    draft_flops_per_token,
    gpu_setup,
    tensor_parallel_weights,
    vllm_share,
)
from common.online.options import prefetch_bytes
from common.target.device_plan import (
    DevicePlanError,
    activation_headroom,
    block_sizes,
    parse_size,
    plan_device_map,
)
from common.target.int4_experts import (
    PackedLinear,
    kimi_quantization_config,
    packed_modules,
    parse_quantization_config,
    replace_with_packed,
)
from common.train.memory_plan import DraftDims

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


def plan_online(model: torch.nn.Module, gpus: int, prefetch: int) -> None:
    """04 --online per host type (common/online/host_plan.py)."""
    dims = DraftDims.kimi_k25()
    share = vllm_share(tensor_parallel_weights(model, gpus), model.config, gpus)
    setup = gpu_setup(MIN_TOKENS_PER_STEP, gpus)
    print(f"\n04 --online, one host of {gpus} GPUs: vLLM TP{gpus} and {gpus} torchrun ranks on the same GPUs")
    print(f"  draft: {dims.trainable / 1e9:.2f}B trained parameters, {(dims.embedding + dims.verifier_head) / 1e9:.2f}B "
          f"frozen; {draft_flops_per_token(dims, setup) / 1e9:.0f} GFLOP per trained token (3 TTT steps; "
          f"{draft_flops_per_token(dims, replace(setup, checkpointing=True)) / 1e9:.0f} with checkpointing)")
    window = prefetch_bytes(prefetch, MIN_TOKENS_PER_STEP, dims.hidden)
    print(f"  prefetch window (--prefetch {prefetch}): {window / 1e9:.2f} GB of host memory per rank at 8,192 "
          f"tokens, {gpus * window / 1e9:.1f} GB per host")
    for card in CARDS.values():
        print("\n".join(describe_host(card, share, dims, model.config, gpus)))
    print(assumptions(list(CARDS.values())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--max-memory", default="141GB", help="budget per GPU (default: %(default)s, an H200)")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--online", action="store_true", help="the plan of 04 --online (see above)")
    parser.add_argument("--prefetch", type=int, default=2, help="--online: 04's --prefetch")
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
    else:
        for device, used in plan.used.items():
            print(f"  {device}: {used / 1e9:,.1f} GB weights + {headroom / 1e9:.1f} GB activations "
                  f"= {(used + headroom) / 1e9:,.1f} GB of {budgets[device] / 1e9:,.0f} GB")
    if args.online:
        plan_online(model, args.gpus, args.prefetch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
