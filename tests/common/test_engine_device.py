"""common/engine_device.py: one Runtime from the engine, placement and dtype flags, the defaults decided
in one place (this CPU host: cpu, fp32; vLLM: bf16), bad combinations refused by flag."""

from __future__ import annotations

import argparse

import pytest
import torch

from common.engine_device import Runtime, add_runtime_args, default_device
from common.errors import PipelineError
from common.target.config import load_target_info
from common.target.device_plan import DevicePlanError


def parse(*argv: str, device_map: bool = True, url: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser, "run", device_map=device_map, url=url)
    return parser.parse_args(list(argv))


def test_defaults_on_a_cpu_host():
    runtime = Runtime.from_args(parse())
    assert (runtime.engine, runtime.device, runtime.device_map, runtime.dtype) == ("hf", "cpu", None, torch.float32)
    assert not runtime.vllm and runtime.compute_dtype == torch.float32
    assert runtime.primary_device == torch.device("cpu")
    assert default_device() == "cpu" and default_device("auto") == "cpu" and default_device("cuda:3") == "cuda:3"


def test_dtype_flag_reaches_both_engines():
    runtime = Runtime.from_args(parse("--dtype", "bf16", "--device", "cpu"))
    assert runtime.dtype == runtime.vllm_dtype == torch.bfloat16
    assert Runtime.from_args(parse()).vllm_dtype == torch.bfloat16  # vLLM's own default


def test_vllm_url_without_the_vllm_engine_is_refused():
    with pytest.raises(PipelineError, match="--vllm-url http://h:8000 needs --engine vllm"):
        Runtime.from_args(parse("--vllm-url", "http://h:8000", url=True))


def test_vllm_url_needs_no_environment():
    runtime = Runtime.from_args(parse("--engine", "vllm", "--vllm-url", "http://h:8000", url=True))
    assert runtime.vllm and runtime.vllm_url == "http://h:8000" and runtime.vllm_python is None
    assert runtime.compute_dtype == torch.bfloat16


def test_missing_vllm_environment_is_one_line(tmp_path):
    with pytest.raises(PipelineError, match=f"vLLM not found: no --vllm-python {tmp_path / 'none'}"):
        Runtime.from_args(parse("--engine", "vllm", "--vllm-python", str(tmp_path / "none")))


def test_placement_flags_are_checked_before_anything_loads():
    with pytest.raises(DevicePlanError, match="--max-memory 10GiB: only used with --device-map auto"):
        Runtime.from_args(parse("--max-memory", "10GiB"))
    with pytest.raises(SystemExit):  # argparse: --device and --device-map exclude each other
        parse("--device", "cpu", "--device-map", "auto")
    assert not hasattr(parse(device_map=False), "device_map")


def test_check_target_refuses_what_its_vllm_engine_cannot_run_here(kimi_target):
    """INT4 DeepSeek-V3-routed experts on a CPU: refused for the vLLM worker, not for the HF engine
    nor for a server given by URL (already running: it decided itself)."""
    info = load_target_info(kimi_target, trust_remote_code=True)
    with pytest.raises(PipelineError, match="routed experts are INT4"):
        Runtime(engine="vllm").check_target(info)
    Runtime(engine="hf").check_target(info)
    Runtime(engine="vllm", vllm_url="http://h:8000").check_target(info)
