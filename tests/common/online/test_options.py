"""04 --online's flags (`OnlineOptions`): defaults filled in, each flag refused without --online,
and the prefetch window's memory as its help states it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from common.cli import stage_parser
from common.errors import PipelineError
from common.online.options import DEFAULT_PREFETCH, OnlineOptions, prefetch_bytes


def parse(*argv: str) -> argparse.Namespace:
    parser = stage_parser("04's online flags.")
    parser.add_argument("--data", type=Path, default=None)
    OnlineOptions.add_args(parser)
    return parser.parse_args(["--run-dir", "RUN", *argv])


def test_prefetch_memory_is_what_the_help_says():
    # Kimi-K2.5 (hidden 7168) at 8,192 tokens per batch: 470 MB per batch held
    assert prefetch_bytes(1, 8192, 7168) == 8192 * 4 * 7168 * 2 == 469_762_048
    assert prefetch_bytes(2, 8192, 7168) == 2 * 469_762_048


def test_offline_is_none_and_online_fills_in_the_defaults():
    assert OnlineOptions.from_args(parse()) is None
    options = OnlineOptions.from_args(parse("--online", "--max-disk", "2K", "--layer-ids", "1", "2", "3"))
    assert (options.prepared, options.storage, options.batch_tokens, options.prefetch, options.max_disk) == (
        Path("RUN/prepared"), "bf16", 8192, DEFAULT_PREFETCH, 2000)
    assert (options.layer_ids, options.max_samples, options.gpu_memory_utilization) == ([1, 2, 3], None, None)
    assert options.runtime_args.engine == "hf"


@pytest.mark.parametrize("flag", ["--prepared=p", "--max-samples=3", "--layer-ids=1", "--storage=fp8",
                                  "--batch-tokens=9", "--prefetch=2", "--max-disk=1G",
                                  "--gpu-memory-utilization=0.5", "--engine=vllm", "--vllm-python=py",
                                  "--vllm-url=http://h:1", "--tensor-parallel-size=2", "--dtype=bf16",
                                  "--device-map=auto", "--max-memory=1GiB"])
def test_every_flag_of_the_engine_needs_online(flag):
    name = flag.partition("=")[0]
    with pytest.raises(PipelineError, match=f"^{name} needs --online \\(04 reads 02's files otherwise\\)$"):
        OnlineOptions.from_args(parse(flag))
