"""Hidden-state storage (common/hidden_states/storage.py): per-row scaled e4m3 against its error bound,
outliers in the thousands, bytes per token, the sample file and the library's dataset reading it."""

from __future__ import annotations

import pytest
import torch
from speculators.train.data import Eagle3SampleFileDataset, standardize_data_v1

from common.errors import PipelineError
from common.hidden_states.data_config import NUM_STATES
from common.hidden_states.state_files import is_valid_sample, sample_path, save_sample
from common.hidden_states.storage import (
    FP8_DTYPE,
    SCALES_KEY,
    STORAGES,
    dequantize_rows,
    get_storage,
    quantize_rows,
    standardize_fn,
)

FP8 = STORAGES["fp8"]
BF16 = STORAGES["bf16"]
E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: round to nearest is within 1/16 of a normal value
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # half the smallest subnormal step 2^-9, in units of the scale


def states_with_outliers(rows: int = 64, hidden: int = 512, outlier: float = 3000.0, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with a massive-activation channel (the residual stream of large models)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    x[:, 7] = outlier
    x[3, hidden - 1] = -3 * outlier
    return x


def test_every_entry_is_within_the_e4m3_bound_of_its_row_scale():
    x = states_with_outliers() * torch.logspace(-3, 3, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.bfloat16 and scale.shape == (64,)
    err = (dequantize_rows(q, scale) - x).abs()
    bound = torch.maximum(x.abs() * E4M3_HALF_ULP, scale.float()[:, None] * E4M3_SUBNORMAL_HALF_STEP)
    assert bool((err <= bound * 1.0001).all())
    # The largest entry of each row lands on the top of e4m3's range, not past it.
    assert float(q.float().abs().amax(dim=-1).min()) >= 416 and float(q.float().abs().max()) <= 448


def test_outliers_in_the_thousands_survive_where_an_unscaled_cast_clips_at_448():
    x = states_with_outliers(outlier=3000.0)
    unscaled = x.to(FP8_DTYPE).float()
    assert float(unscaled.abs().max()) == 448  # torch saturates: 3000 and -9000 become +-448
    assert float((unscaled - x).norm() / x.norm()) > 0.8
    q, scale = quantize_rows(x)
    back = dequantize_rows(q, scale)
    assert float(((back - x)[:, 7].abs() / 3000).max()) <= E4M3_HALF_ULP
    assert abs(float(back[3, -1]) + 9000) <= 9000 * E4M3_HALF_ULP
    assert float((back - x).norm() / x.norm()) < 0.01
    # The ordinary channels of the outlier rows keep e4m3's precision: no finer scale is needed.
    rest = torch.ones(x.shape[1], dtype=torch.bool)
    rest[[7, x.shape[1] - 1]] = False
    assert float((back - x)[:, rest].norm() / x[:, rest].norm()) < 0.03


def test_zero_rows_and_huge_rows_stay_finite():
    x = torch.zeros(3, 16)
    x[1] = 1e30
    x[2, 0] = -1e-30
    q, scale = quantize_rows(x)
    back = dequantize_rows(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back[0], x[0])
    torch.testing.assert_close(back, x, rtol=E4M3_HALF_ULP, atol=0)


def test_bytes_per_token_includes_the_scales():
    assert BF16.bytes_per_token(NUM_STATES, 7168) == 57_344
    assert FP8.bytes_per_token(NUM_STATES, 7168) == 4 * (7168 + 2)
    assert FP8.bytes_per_token(NUM_STATES, 7168) / BF16.bytes_per_token(NUM_STATES, 7168) < 0.5002
    assert FP8.bytes_per_token(NUM_STATES, 64) / BF16.bytes_per_token(NUM_STATES, 64) <= 0.53  # the miniature


def test_unknown_storage_is_refused():
    with pytest.raises(PipelineError, match="storage 'int4': expected one of bf16, fp8"):
        get_storage("int4")


def write_fp8_sample(root, index: int, states: list[torch.Tensor]) -> None:
    n = states[0].shape[0]
    stored, scales = FP8.encode(states)
    save_sample(root, index, torch.arange(n), stored, torch.ones(n, dtype=torch.long), scales)


def test_fp8_file_holds_v1_keys_plus_scales_and_the_library_dataset_reads_it(tmp_path):
    states = [states_with_outliers(rows=20, hidden=64, seed=k) for k in range(NUM_STATES)]
    write_fp8_sample(tmp_path, 0, states)
    path = sample_path(tmp_path, 0)
    data = torch.load(path, weights_only=True, mmap=True)
    assert set(data) == {"input_ids", "hidden_states", "loss_mask", SCALES_KEY}
    assert [s.dtype for s in data["hidden_states"]] == [FP8_DTYPE] * 4 and data[SCALES_KEY].shape == (4, 20)
    assert is_valid_sample(path, list(range(20)), 64, FP8) and not is_valid_sample(path, list(range(20)), 64, BF16)

    dataset = Eagle3SampleFileDataset(max_len=64, file_list=[str(path)], standardize_fn=standardize_fn("fp8"))
    item = dataset[0]
    decoded = FP8.decode(data)
    # The dataset drops the last aux position and the first final state when it shifts inputs and targets.
    assert torch.equal(item["hidden_states"], torch.cat(decoded[:3], dim=-1)[:-1])
    assert torch.equal(item["verifier_last_hidden_states"], decoded[3][1:])
    for back, exact in zip(decoded, states, strict=True):
        assert float((back - exact).norm() / exact.norm()) < 0.01


def test_bf16_folders_keep_the_library_standardize():
    assert standardize_fn("bf16") is standardize_data_v1 and standardize_fn("fp8") is not standardize_data_v1


def test_fp8_file_without_its_scales_is_not_a_valid_sample(tmp_path):
    states = [torch.randn(5, 64) for _ in range(NUM_STATES)]
    stored, _ = FP8.encode(states)
    save_sample(tmp_path, 0, torch.arange(5), stored, torch.ones(5, dtype=torch.long))
    assert not is_valid_sample(sample_path(tmp_path, 0), list(range(5)), 64, FP8)
