"""common/online/host_plan.py: vLLM's share of a GPU, the layout search and the rate of 04 --online on
one host."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config

from common.miniatures.targets import KIMI_TEXT_CONFIG
from common.online.host_plan import (
    CARDS,
    MIN_TOKENS_PER_STEP,
    SPARE,
    Card,
    VllmSettings,
    candidates,
    describe_host,
    fsdp_bytes_per_pack,
    gpu_setup,
    mla_kv_bytes_per_token,
    rates,
    search_layout,
    tensor_parallel_weights,
    vllm_share,
    what_to_change,
)
from common.target.device_plan import block_sizes
from common.target.int4_experts import (
    kimi_quantization_config,
    packed_modules,
    parse_quantization_config,
    replace_with_packed,
)
from common.train.memory_plan import DraftDims

KIMI = DraftDims.kimi_k25()
# Kimi-K2.5's text config where it differs from the miniature's (scripts/plan_kimi_k25.py's KIMI_K25_SHAPE)
KIMI_CONFIG = DeepseekV3Config(**{**KIMI_TEXT_CONFIG, "hidden_size": 7168, "num_hidden_layers": 61,
                                  "num_attention_heads": 64, "n_routed_experts": 384, "num_experts_per_tok": 8,
                                  "moe_intermediate_size": 2048, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                                  "v_head_dim": 128})
KIMI_WEIGHTS = (76_000_000_000, 2_000_000_000)  # per GPU and replicated, near what the meta model gives


@pytest.fixture(scope="module")
def miniature_meta_model() -> torch.nn.Module:
    """The miniature Kimi text model on meta, its routed experts packed as the full-size plan builds them."""
    from accelerate import init_empty_weights
    from transformers import DeepseekV3ForCausalLM

    quantization = parse_quantization_config(kimi_quantization_config(), "Kimi-K2.5")
    with init_empty_weights():
        model = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**KIMI_TEXT_CONFIG), dtype=torch.bfloat16)
        replace_with_packed(model, packed_modules(model, quantization, "language_model."))
    return model


def test_tensor_parallel_ranks_split_all_but_the_replicated_weights(miniature_meta_model):
    total = sum(size for _, size in block_sizes(miniature_meta_model, torch.bfloat16))
    one, replicated_one = tensor_parallel_weights(miniature_meta_model, 1)
    eight, replicated = tensor_parallel_weights(miniature_meta_model, 8)
    assert one == total and replicated_one == replicated > 0
    assert eight == (total - replicated) // 8 + replicated
    c = KIMI_TEXT_CONFIG
    layers = c["num_hidden_layers"]
    q_a = c["hidden_size"] * c["q_lora_rank"] * 2
    kv_a = c["hidden_size"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    assert replicated > layers * (q_a + kv_a)  # MLA's down-projections, plus norms and routers


def test_vllm_share_is_weights_plus_a_prefill_engine():
    share = vllm_share(KIMI_WEIGHTS, KIMI_CONFIG, 8)
    assert mla_kv_bytes_per_token(KIMI_CONFIG) == 61 * 576 * 2  # ~70 KB per token
    assert share.kv_cache == 2 * VllmSettings().max_num_batched_tokens * 61 * 576 * 2
    assert share.total == share.weights + share.kv_cache + share.activations + share.runtime
    card = CARDS["rtx-pro-6000"]
    assert share.utilization(card) * card.memory >= share.total > (share.utilization(card) - 0.01) * card.memory
    assert "--enforce-eager" in share.settings.flags(share.kv_cache)
    assert f"--kv-cache-memory-bytes {share.kv_cache}" in share.settings.flags(share.kv_cache)


def test_candidates_make_up_the_tokens_per_step_largest_pack_first():
    packs = [s.total_seq_len for s in candidates(8)]
    assert packs == sorted(packs, reverse=True)
    assert all(s.total_seq_len * s.grad_accum >= MIN_TOKENS_PER_STEP for s in candidates(8))
    assert [s.checkpointing for s in candidates(8)[:2]] == [False, True]  # plain first where it fits


def test_h200_host_fits_the_largest_pack_without_checkpointing():
    share = vllm_share(KIMI_WEIGHTS, KIMI_CONFIG, 8)
    layout = search_layout(CARDS["h200"], share, KIMI, 8)
    assert layout is not None and layout.spare >= SPARE
    assert layout.trainer.setup == gpu_setup(8192, 8)


def test_a_card_too_small_fits_nothing_and_says_what_to_change():
    share = vllm_share(KIMI_WEIGHTS, KIMI_CONFIG, 8)
    small = Card("small", int(share.total / 0.95), 500e12, 30e9)  # room for vLLM alone
    assert search_layout(small, share, KIMI, 8) is None
    lines, fallback = what_to_change(small, share, KIMI, 8)
    assert fallback is None and any("second host" in line for line in lines)
    text = "\n".join(describe_host(small, share, KIMI, KIMI_CONFIG, 8))
    assert "does NOT fit" in text


def test_96_gb_host_fills_8192_tokens_per_step_with_accumulation():
    """Beside vLLM on a 96 GB card the largest pack that keeps 10% spare is checkpointed 2,048 tokens,
    --grad-accum 4 making up 8,192 per rank and step (it costs no gradient memory under FSDP)."""
    share = vllm_share(KIMI_WEIGHTS, KIMI_CONFIG, 8)
    layout = search_layout(CARDS["rtx-pro-6000"], share, KIMI, 8)
    assert layout is not None and layout.spare >= SPARE
    assert layout.trainer.setup == gpu_setup(2048, 8, grad_accum=4, checkpointing=True)
    assert layout.tokens_per_step == MIN_TOKENS_PER_STEP


def test_fsdp_traffic_and_the_bounds_of_the_rate():
    setup = gpu_setup(2048, 8, grad_accum=4)
    assert fsdp_bytes_per_pack(KIMI, setup) == fsdp_bytes_per_pack(KIMI, replace(setup, grad_accum=1))
    checkpointed = replace(setup, checkpointing=True)  # looks the embedding up once, not at each TTT step
    assert fsdp_bytes_per_pack(KIMI, setup) - fsdp_bytes_per_pack(KIMI, checkpointed) == \
        7 / 8 * 2 * 2 * KIMI.embedding
    nvlink = rates(CARDS["h200"], KIMI, gpu_setup(8192, 8), KIMI_CONFIG, 8)
    pcie = rates(CARDS["rtx-pro-6000"], KIMI, gpu_setup(8192, 8), KIMI_CONFIG, 8)
    assert nvlink.prefill_bound == "compute" and pcie.prefill_bound == "all-reduces"
    assert pcie.shared < min(pcie.prefill, pcie.train) and pcie.two_hosts == min(pcie.prefill, pcie.train)
