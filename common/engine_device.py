"""Where and how a stage runs the target: the engine (transformers in this process, or vLLM from
its own environment), the device or device map, and the compute dtype.

The flags are added by `add_runtime_args` and turned into one `Runtime` by `Runtime.from_args`,
the one place where the defaults are decided: one GPU per process (cuda:LOCAL_RANK) when there is
one, else the CPU; bf16 on a GPU and under vLLM (its CPU kernels are slow in fp32), fp32 on a CPU.
Stages receive the `Runtime` and never look at the engine flags themselves.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.errors import PipelineError
from common.target.config import TargetInfo
from common.target.device_plan import check_placement_flags
from common.vllm.client import check_servable, check_vllm_python, vllm_device

# --dtype of the stages that run the target (00, 02, 05)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ENGINES = ("hf", "vllm")


def default_device(flag: str | None = None) -> str:
    """`flag`, or this process's GPU (cuda:LOCAL_RANK under torchrun) when there is one, else the CPU."""
    if flag not in (None, "auto"):
        return flag
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Runtime:
    """The engine, placement and dtype one stage runs the target with."""

    engine: str = "hf"
    device: str | None = "cpu"  # None under a device map
    device_map: str | None = None  # "auto": the target spread over the visible GPUs
    max_memory: str | None = None
    dtype: torch.dtype = torch.float32  # compute dtype of this process's models
    vllm_dtype: torch.dtype = torch.bfloat16  # what vLLM serves the target in
    vllm_python: Path | None = None  # the vLLM environment's python (--engine vllm without a URL)
    vllm_url: str | None = None  # a running server: `vllm serve` (00), the hidden-state server (04 --online)
    tensor_parallel_size: int = 1

    @property
    def vllm(self) -> bool:
        return self.engine == "vllm"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the target runs in, whichever engine runs it."""
        return self.vllm_dtype if self.vllm else self.dtype

    @property
    def primary_device(self) -> torch.device:
        """Where inputs and a small model (the draft) go: the device, or the first GPU of a map."""
        return torch.device(self.device or "cuda:0")

    def check_target(self, info: TargetInfo, drafts: Iterable[Path] = ()) -> None:
        """Refuse now, before anything heavy, a target (alone, and with each draft) that the vLLM
        engine this runtime starts cannot run on this host; every engine start checks it again."""
        if self.vllm and not self.vllm_url:
            for draft in [None, *drafts]:
                check_servable(info, vllm_device(), draft)

    def describe(self) -> str:
        if self.vllm:
            return f"vLLM ({self.vllm_url or 'own engine'}, {str(self.vllm_dtype).removeprefix('torch.')})"
        return f"{self.device or 'device map auto'}, {str(self.dtype).removeprefix('torch.')}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Runtime:
        """The runtime of the flags `add_runtime_args` added (placement flags checked, the vLLM
        environment probed, before anything heavy is loaded)."""
        device_map, max_memory = getattr(args, "device_map", None), getattr(args, "max_memory", None)
        check_placement_flags(device_map, max_memory)
        device = None if device_map else default_device(getattr(args, "device", None))
        on_gpu = device_map is not None or (device or "").startswith("cuda")
        explicit = DTYPES[args.dtype] if getattr(args, "dtype", None) else None
        url = getattr(args, "vllm_url", None)
        if url and args.engine != "vllm":
            raise PipelineError(f"--vllm-url {url} needs --engine vllm")
        python = check_vllm_python(args.vllm_python) if args.engine == "vllm" and not url else None
        return cls(engine=args.engine, device=device, device_map=device_map, max_memory=max_memory,
                   dtype=explicit or (torch.bfloat16 if on_gpu else torch.float32),
                   vllm_dtype=explicit or torch.bfloat16, vllm_python=python, vllm_url=url,
                   tensor_parallel_size=args.tensor_parallel_size)


def add_runtime_args(parser: argparse.ArgumentParser, what: str, *, device_map: bool = True,
                     url: bool = False, url_help: str | None = None, device: bool = True) -> None:
    """The engine, placement and dtype flags of a stage that runs the target (`what` it does with it).
    `device=False`: the stage has its own `--device` (04's, for the draft and the target alike)."""
    group = parser.add_argument_group("engine and placement")
    group.add_argument("--engine", choices=ENGINES, default="hf",
                       help=f"{what} with transformers (hf, default) or with vLLM from its own environment")
    group.add_argument("--vllm-python", type=Path, default=None,
                       help=f"python of the vLLM environment (default: {DEFAULT_VLLM_PYTHON.relative_to(REPO_ROOT)}, "
                            "made by scripts/setup_vllm_env.sh)")
    if url:
        group.add_argument("--vllm-url", default=None, metavar="URL",
                           help=url_help or "--engine vllm: a running vLLM server (`vllm serve TARGET`, e.g. "
                                            "http://host:8000) instead of starting one")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="vLLM: GPUs one engine spreads the target over (8 for Kimi-K2.5 on one host)")
    group.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                       help="compute dtype (default: bf16 on a GPU and with --engine vllm, fp32 on the CPU)")
    placement = group.add_mutually_exclusive_group()
    if device:
        placement.add_argument("--device", default=None,
                               help="hf engine: e.g. cuda:0 or cpu (default: cuda:LOCAL_RANK if a GPU is present)")
    if device_map:
        placement.add_argument("--device-map", choices=["auto"], default=None,
                               help="spread one large target over all visible GPUs (planned from its packed sizes; "
                                    "refused, never offloaded, when it does not fit)")
        group.add_argument("--max-memory", default=None, metavar="SIZE",
                           help="with --device-map auto: budget per GPU, e.g. 130GiB or 0=130GiB,1=120GiB "
                                "(default: each GPU's free memory)")
