"""Computed, not measured: what Kimi-K2.5 needs per GPU under `--device-map auto`.

Builds Kimi-K2.5's text model at full size on the meta device (no memory, no download: the
shapes of its published text_config, INT4 routed experts as `PackedLinear`), takes the bytes of
every block as the loader will hold them, and runs the same planner 02 and 05 use, for a given
number of GPUs and budget per GPU. It prints the totals (routed experts packed, their scales,
everything else in bf16), the activation headroom for `--batch-tokens`, and the plan, or the
refusal the scripts would print. Building the 61 layers x 384 experts on meta takes a few minutes.

With `--online`, the plan of 04 --online instead: for one host of 8 x H200 and one of 8 x 96 GB
cards (target and trainer sharing the GPUs) and for two hosts (the target on one, the trainer on
the other), the memory per GPU of the target (vLLM TP8, and the HF device map), of the draft's
training (FSDP over 8 ranks at --total-seq-len) and of the prefetch window, whether it fits, and
the tokens/s to expect from the target's prefill FLOPs and the draft's training FLOPs at the
stated utilisations (estimates, not measurements: bench/gpu_train_full_shape.py measures the draft).

Usage:
    python scripts/plan_kimi_k25.py                                   # 8 x 141 GB (H200), 16384 tokens
    python scripts/plan_kimi_k25.py --gpus 8 --max-memory 96GB        # an 8 x 96 GB host
    python scripts/plan_kimi_k25.py --gpus 1 --max-memory 141GB       # one H200: refused
    python scripts/plan_kimi_k25.py --online [--total-seq-len 8192] [--prefetch 2]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common.miniatures.targets import KIMI_TEXT_CONFIG
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


# --- 04 --online: estimates -------------------------------------------------------------------------
KIMI_ACTIVE_PARAMS = 32e9  # Kimi-K2.5's activated parameters per token (its model card)
VERIFIER_VOCAB, DRAFT_VOCAB, HIDDEN = 163_840, 32_000, 7168
# The draft of configs/draft_kimi_k25.json: fc (3H -> H), attention on 2H inputs (q, k, v: 2H -> 64 x 128;
# o: 8192 -> H), a SwiGLU MLP of 18432, the draft lm_head; embed_tokens and the verifier lm_head are frozen.
DRAFT_TRAINABLE = 3 * HIDDEN * HIDDEN + 3 * 2 * HIDDEN * 8192 + 8192 * HIDDEN + 3 * HIDDEN * 18432 + DRAFT_VOCAB * HIDDEN
DRAFT_FROZEN = 2 * VERIFIER_VOCAB * HIDDEN
TTT_STEPS = 3
# Utilisation assumed for the expected rate: training a dense layer (the measured figure belongs to
# bench/gpu_train_full_shape.py), and vLLM's prefill of an INT4 MoE (memory-bound expert matmuls).
TRAIN_MFU, PREFILL_MFU = 0.40, 0.30
HOSTS = {"8 x H200 (141 GB, 989 TFLOPs bf16 dense)": (141e9, 989e12),
         "8 x 96 GB (RTX PRO 6000 Blackwell class, ~500 TFLOPs bf16 dense)": (96e9, 500e12)}
VLLM_OVERHEAD = 6e9  # per GPU: CUDA graphs, NCCL buffers, the prefill's KV blocks (MLA: 70 KB/token) and workspace


def draft_training_bytes(total_seq_len: int, ranks: int) -> tuple[int, int]:
    """(bytes per GPU of the draft's training under FSDP over `ranks`, of which activations): fp32
    weights, gradients and two optimizer moments sharded (16 B per trainable parameter), the frozen bf16
    embedding and verifier lm_head on every rank, and per TTT step the fp32 draft logits and their
    gradient, the target's probabilities over the draft vocabulary, and ~40 hidden-wide bf16 tensors
    per token kept for the backward pass; the batch's four states in fp32 (the loader's dtype)."""
    sharded = DRAFT_TRAINABLE * 16 // ranks
    activations = (TTT_STEPS * total_seq_len * (DRAFT_VOCAB * 4 * 3 + HIDDEN * 2 * 40)
                   + total_seq_len * VERIFIER_VOCAB * 2 + total_seq_len * 4 * HIDDEN * 4)
    return sharded + DRAFT_FROZEN * 2 + activations, activations


def plan_online(total_weights: int, hf_plan: str, total_seq_len: int, prefetch: int) -> None:
    """04 --online on one shared host and on two hosts, per host type (see the module docstring)."""
    target_prefill = 2 * KIMI_ACTIVE_PARAMS  # FLOPs per token (attention at 2K tokens adds a few %)
    draft_step = 6 * DRAFT_TRAINABLE * TTT_STEPS  # forward + backward per token and TTT step
    train, activations = draft_training_bytes(total_seq_len, 8)
    single, _ = draft_training_bytes(total_seq_len, 1)
    window = prefetch * total_seq_len * 4 * HIDDEN * 2
    vllm = total_weights / 8 + VLLM_OVERHEAD
    print(f"\n04 --online, --total-seq-len {total_seq_len:,}, --prefetch {prefetch}:")
    print(f"  draft: {DRAFT_TRAINABLE / 1e9:.2f}B trainable parameters ({draft_step / 1e9:.0f} GFLOP per token over "
          f"{TTT_STEPS} TTT steps), {DRAFT_FROZEN / 1e9:.2f}B frozen; FSDP over 8 ranks: {train / 1e9:.1f} GB per GPU "
          f"({activations / 1e9:.1f} GB of it activations)")
    print(f"  target: {target_prefill / 1e9:.0f} GFLOP per token of prefill; vLLM TP8 {vllm / 1e9:.1f} GB per GPU "
          f"({total_weights / 8e9:.1f} GB weights + {VLLM_OVERHEAD / 1e9:.0f} GB engine); HF device map: {hf_plan}")
    print(f"  prefetch window: {window / 1e9:.2f} GB of host memory per rank ({prefetch} x {total_seq_len:,} x 4 x "
          f"{HIDDEN} x 2 bytes), {8 * window / 1e9:.1f} GB per host")
    tokens = 500_000 * 2048 * 3  # the 500K preset: 3 epochs of 2,048-token conversations
    for host, (memory, peak) in HOSTS.items():
        shared = vllm + train
        fits = "fits" if shared <= memory * 0.95 else "does NOT fit"
        rate_shared = 8 * peak / (target_prefill / PREFILL_MFU + draft_step / TRAIN_MFU)
        rate_two = min(8 * peak * PREFILL_MFU / target_prefill, 8 * peak * TRAIN_MFU / draft_step)
        print(f"  {host}:")
        print(f"    one host, the hidden-state server shared by 8 torchrun ranks (--vllm-url): {shared / 1e9:.1f} GB of {memory / 1e9:.0f} GB per GPU: {fits} "
              f"(vLLM --gpu-memory-utilization {vllm / memory:.2f}); ~{rate_shared:,.0f} tokens/s "
              f"({rate_shared / 8:,.0f} per GPU), "
              f"500K x 2,048 tokens x 3 epochs in ~{tokens / rate_shared / 3600:.0f} h")
        rate_one = min(8 * peak * PREFILL_MFU / target_prefill, peak * TRAIN_MFU / draft_step)
        print(f"    one process, the draft on cuda:0 beside its vLLM worker (TP8): cuda:0 holds "
              f"{(vllm + single) / 1e9:.1f} GB of {memory / 1e9:.0f} GB "
              f"({'fits' if vllm + single <= memory * 0.95 else 'does NOT fit'}); ~{rate_one:,.0f} tokens/s "
              f"(one GPU trains), ~{tokens / rate_one / 3600:.0f} h")
        print(f"    two hosts, the target (TP8) on one, the trainer on the other: target {vllm / 1e9:.1f} GB, trainer "
              f"{train / 1e9:.1f} GB per GPU; ~{rate_two:,.0f} tokens/s (the slower side), ~{tokens / rate_two / 3600:.0f} h")
    print(f"  utilisation assumed: draft training {TRAIN_MFU:.0%}, target prefill {PREFILL_MFU:.0%} of the bf16 peak. "
          "For scale, a published Kimi-K2.5 draft: 600K samples, 6B tokens, ~1,500 H200-hours with 16 inference and "
          f"16 training GPUs: {6e9 / (1500 * 3600):,.0f} tokens/s per GPU.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--max-memory", default="141GB", help="budget per GPU (default: %(default)s, an H200)")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--online", action="store_true", help="the plan of 04 --online (see above)")
    parser.add_argument("--total-seq-len", type=int, default=8192, help="--online: 04's tokens per rank and step")
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
        if args.online:
            plan_online(total, "refused (above)", args.total_seq_len, args.prefetch)
        return 0
    for device, used in plan.used.items():
        print(f"  {device}: {used / 1e9:,.1f} GB weights + {headroom / 1e9:.1f} GB activations "
              f"= {(used + headroom) / 1e9:,.1f} GB of {budgets[device] / 1e9:,.0f} GB")
    if args.online:
        worst = max(plan.used.values()) + headroom
        plan_online(total, f"up to {worst / 1e9:.1f} GB per GPU (above; the trainer's share comes on top)",
                    args.total_seq_len, args.prefetch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
