"""`--device-map auto` planning (common/target/device_plan.py): real packed bytes per block, explicit
budgets, activation headroom, refusal instead of offloading. Pure arithmetic, so it runs on CPU
with fake device budgets; the placement itself needs GPUs."""

from __future__ import annotations

import pytest
import torch
from helpers import run_script

from common.target.config import load_target_info, read_tensors, weight_map
from common.target.device_plan import (
    GIB,
    DevicePlanError,
    activation_headroom,
    block_sizes,
    check_placement_flags,
    parse_max_memory,
    parse_size,
    plan_device_map,
)
from common.target.int4_experts import PackedLinear
from common.target.model import empty_text_model, load_text_model

GPUS = [f"cuda:{i}" for i in range(4)]


@pytest.fixture(scope="module")
def meta_model(kimi_target):
    return empty_text_model(load_target_info(kimi_target, trust_remote_code=True), torch.bfloat16)


def test_sizes_and_budgets_parse():
    assert parse_size("141GiB") == 141 * GIB and parse_size("80GB") == 80 * 10**9 and parse_size("1024") == 1024
    assert parse_size("1.5TiB") == int(1.5 * 2**40)
    assert parse_size("500G") == 500 * 10**9 and parse_size("5T") == 5 * 10**12  # bare: decimal, as disks are sold
    assert parse_max_memory("100GiB", GPUS[:2]) == {"cuda:0": 100 * GIB, "cuda:1": 100 * GIB}
    assert parse_max_memory("0=10GiB,1=20GiB", GPUS) == {"cuda:0": 10 * GIB, "cuda:1": 20 * GIB}
    with pytest.raises(DevicePlanError, match="--max-memory 'lots'"):
        parse_size("lots")
    with pytest.raises(DevicePlanError, match="device '7' is not one of"):
        parse_max_memory("7=10GiB", GPUS)


def test_block_sizes_are_the_packed_bytes_on_disk(kimi_target, meta_model):
    """In bf16 every block holds exactly the bytes its tensors take on disk (experts packed)."""
    assert any(isinstance(m, PackedLinear) for m in meta_model.modules())
    blocks = dict(block_sizes(meta_model, torch.bfloat16))
    assert list(blocks)[:2] == ["model.embed_tokens", "model.layers.0"] and list(blocks)[-1] == "lm_head"
    wmap = weight_map(kimi_target)
    disk = read_tensors(kimi_target, [k for k in wmap if k.startswith("language_model.")])
    for block in ("model.layers.1", "model.layers.7", "model.embed_tokens", "lm_head"):
        prefix = f"language_model.{block}."
        assert blocks[block] == sum(t.numel() * t.element_size() for k, t in disk.items() if k.startswith(prefix))
    # fp32 compute doubles the unquantized tensors only, never the packed experts
    fp32 = dict(block_sizes(meta_model, torch.float32))
    experts = sum(t.numel() * t.element_size() for k, t in disk.items() if ".layers.1.mlp.experts." in k)
    assert fp32["model.layers.1"] - experts == 2 * (blocks["model.layers.1"] - experts)


def test_plan_spreads_blocks_in_order_and_evenly():
    blocks = [("model.embed_tokens", 10)] + [(f"model.layers.{i}", 20) for i in range(8)] + [("lm_head", 10)]
    plan = plan_device_map(blocks, dict.fromkeys(GPUS, 100), headroom=5)
    order = [GPUS.index(plan.placement[name]) for name, _ in blocks]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}  # forward order, every GPU used
    assert max(plan.used.values()) - min(plan.used.values()) <= 20  # within one block of even
    assert sum(plan.used.values()) == 180


def test_uneven_budgets_fall_back_to_filling_each_device():
    blocks = [(f"b{i}", 10) for i in range(10)]
    plan = plan_device_map(blocks, {"cuda:0": 95, "cuda:1": 15}, headroom=5)
    assert plan.used == {"cuda:0": 90, "cuda:1": 10}


def test_a_target_that_does_not_fit_is_refused_with_needed_and_available():
    blocks = [(f"model.layers.{i}", 30 * GIB) for i in range(4)]
    with pytest.raises(DevicePlanError) as error:
        plan_device_map(blocks, {"cuda:0": 64 * GIB, "cuda:1": 40 * GIB}, headroom=8 * GIB)
    message = str(error.value)
    assert "needs 120.00 GiB of weights (largest block 30.00 GiB) plus 8.00 GiB of activations per device" in message
    assert "cuda:0: budget 64.00 GiB, 56.00 GiB left for weights" in message
    assert "cuda:1: budget 40.00 GiB, 32.00 GiB left for weights" in message
    assert "Nothing is offloaded to CPU or disk" in message
    # the headroom is what tips it: without it the same budgets hold these blocks
    assert plan_device_map(blocks[:3], {"cuda:0": 64 * GIB, "cuda:1": 40 * GIB}, headroom=0).used


def test_headroom_grows_with_batch_tokens_and_logits(kimi_target):
    config = load_target_info(kimi_target, trust_remote_code=True).text_config
    small, large = (activation_headroom(config, n, torch.bfloat16) for n in (1024, 8192))
    transient = 2 * 3 * config.moe_intermediate_size * config.hidden_size * 2
    assert large - transient == pytest.approx(8 * (small - transient), rel=1e-6)
    with_logits = activation_headroom(config, 1024, torch.bfloat16, logits=True)
    assert with_logits - small == 2 * 1024 * config.vocab_size * 4


def test_flags_are_checked_before_any_work(monkeypatch):
    with pytest.raises(DevicePlanError, match="--max-memory 80GiB: only used with --device-map auto"):
        check_placement_flags(None, "80GiB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DevicePlanError, match="no GPU is visible; .* never offloads to CPU or disk"):
        check_placement_flags("auto", None)
    assert check_placement_flags(None, None) is None


def test_loader_refuses_device_map_auto_without_gpus(kimi_target, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DevicePlanError, match="no GPU is visible"):
        load_text_model(load_target_info(kimi_target, trust_remote_code=True), dtype=torch.bfloat16, device_map="auto")


@pytest.mark.slow
def test_script_refuses_device_map_auto_on_cpu(tmp_path, kimi_target):
    proc = run_script("02_extract_hidden_states.py", "--run-dir", tmp_path, "--target", kimi_target,
                      "--trust-remote-code", "--device-map", "auto", check=False,
                      env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --device-map auto: no GPU is visible")
