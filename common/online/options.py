"""04 `--online`'s flags as one dataclass: `OnlineOptions.add_args` adds them (the online group and
the engine and placement flags of common/engine_device.py), `OnlineOptions.from_args` checks them
and returns the options, or None when `--online` is off; then any of those flags given is refused,
the list of them read off the parser itself."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.cli import stage_dir
from common.engine_device import add_runtime_args
from common.errors import PipelineError
from common.extract.batches import DEFAULT_BATCH_TOKENS
from common.hidden_states.data_config import NUM_STATES
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES
from common.target.device_plan import parse_size

DEFAULT_PREFETCH = 2  # batches computed ahead: one keeps the engine busy while a step trains, two absorb jitter
GROUP = "online (--online: the target computes each batch's hidden states as the draft trains; no 02 needed)"


def prefetch_bytes(prefetch: int, total_seq_len: int, hidden_size: int) -> int:
    """Host memory the prefetch window holds: `prefetch` batches of four bf16 states per token."""
    return prefetch * total_seq_len * NUM_STATES * hidden_size * 2


def _flag(default: Any, text: str, **spec: Any) -> Any:
    """A field with its flag: `add_argument` keywords (the flag's default is None, unset: `default` stands)."""
    return field(default=default, metadata={"flag": {"default": None, "help": text, **spec}})


@dataclass(frozen=True)
class OnlineOptions:
    """What 04 --online computes the states with: 01's prepared rows, the layers, the rounding, the
    batches and the prefetch window, what is kept on disk, and the engine's flags."""

    prepared: Path | None = _flag(None, "--online: prepared dataset of 01 (default: RUN_DIR/prepared)", type=Path)
    max_samples: int | None = _flag(None, "--online: only the first N prepared rows", type=int)
    layer_ids: list[int] | None = _flag(None, "--online: three auxiliary layer ids, vLLM convention (default: 2 N//2 "
                                              "N-3, as 02)", type=int, nargs="+", metavar="I")
    storage: str = _flag(DEFAULT_STORAGE, "--online: round the states as 02 --storage would store them (default: "
                                          "bf16)", choices=sorted(STORAGES))
    batch_tokens: int = _flag(DEFAULT_BATCH_TOKENS, "--online: padded tokens per forward pass of the target "
                                                    f"(default: {DEFAULT_BATCH_TOKENS})", type=int)
    prefetch: int = _flag(DEFAULT_PREFETCH, "--online: batches whose states are computed ahead of the one training "
                                            f"(default: {DEFAULT_PREFETCH}, at least 1); they hold N x total_seq_len "
                                            "x 4 x hidden x 2 bytes of host memory (Kimi-K2.5, 8,192 tokens: 470 MB "
                                            "per batch)", type=int, metavar="N")
    max_disk: int = _flag(0, "--online: keep the states of the first samples computed as 02's files in "
                             "RUN_DIR/hidden_states up to SIZE (bytes, or 500G, 5T, 2TiB), read by later epochs; the "
                             "rest are computed in every epoch (default: 0, none kept)", metavar="SIZE")
    gpu_memory_utilization: float | None = _flag(None, "--online --engine vllm on GPUs: vLLM's share of each GPU, the "
                                                       "rest trains the draft beside it (default: vLLM's 0.9; "
                                                       "scripts/plan_kimi_k25.py --online prints the share Kimi-K2.5 "
                                                       "needs)", type=float, metavar="F")
    # the engine and placement flags (and 04's --device), made a `Runtime` when the engine opens: after
    # the target is read, so that its errors come first
    runtime_args: argparse.Namespace | None = field(default=None, repr=False, compare=False)

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """`--online` and the flags of its engine (each of them refused without it)."""
        online = parser.add_argument_group(GROUP)
        online.add_argument("--online", action="store_true",
                            help="compute the hidden states of 01's prepared rows with the target during training "
                                 "instead of reading 02's files (same layer ids, dtype and storage rounding as 02)")
        for f in cls.__dataclass_fields__.values():
            if "flag" in f.metadata:
                online.add_argument("--" + f.name.replace("_", "-"), **f.metadata["flag"])
        add_runtime_args(parser, "--online: compute the states", device=False, url=True,
                         url_help="--online --engine vllm: a hidden-state server all ranks share (started with "
                                  "scripts/serve_hidden_states.py, e.g. http://host:8100) instead of an engine per "
                                  "rank")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OnlineOptions | None:
        """The options of `--online`, checked; None without it, when none of its flags may be given
        either (04 reads 02's folder, `--data`)."""
        if not args.online:
            given = [dest for dest, default in cls._flag_defaults().items() if getattr(args, dest) != default]
            if given:
                raise PipelineError(f"--{given[0].replace('_', '-')} needs --online (04 reads 02's files otherwise)")
            return None
        if args.data is not None:
            raise PipelineError(f"--data {args.data}: --online computes the hidden states (pass --prepared)")
        for flag, value in (("--prefetch", args.prefetch), ("--batch-tokens", args.batch_tokens),
                            ("--max-samples", args.max_samples)):
            if value is not None and value < 1:
                raise PipelineError(f"{flag} {value}: must be at least 1")
        max_disk = parse_size(args.max_disk, "--max-disk") if args.max_disk is not None else 0
        fraction = args.gpu_memory_utilization
        if fraction is not None and (args.engine != "vllm" or args.vllm_url or not 0 < fraction < 1):
            raise PipelineError(f"--gpu-memory-utilization {fraction}: a share in (0, 1) of each GPU for "
                                "--engine vllm (a server by --vllm-url takes it at its start)")
        given = {name: getattr(args, name) for name, f in cls.__dataclass_fields__.items() if "flag" in f.metadata}
        unset = {name: cls.__dataclass_fields__[name].default for name, value in given.items() if value is None}
        return cls(**{**given, **unset, "prepared": stage_dir(args, "prepared", args.prepared),
                      "max_disk": max_disk, "runtime_args": args})

    @classmethod
    def _flag_defaults(cls) -> dict[str, Any]:
        """Every flag `add_args` adds but `--online` itself, with its default."""
        parser = argparse.ArgumentParser(add_help=False)
        cls.add_args(parser)
        defaults = vars(parser.parse_args([]))
        defaults.pop("online")
        return defaults
