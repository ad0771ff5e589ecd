"""Step 00's settings as one dataclass: `RegenerateOptions` holds what 00_regenerate.py's flags
give (the engines, the turn regenerator and the run each read theirs), `check` refuses a bad value
naming its flag, and `settings` is the JSON form the journal and the report keep."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.errors import PipelineError

__all__ = ["RegenerateOptions"]


@dataclass(frozen=True)
class RegenerateOptions:
    inputs: list[Path]
    target: Path
    output: Path
    temperature: float
    top_p: float
    max_new_tokens: int = 1024
    seed: int = 0
    max_samples: int | None = None
    num_shards: int = 1
    shard_index: int = 0
    part_size: int = 256
    batch_size: int = 8
    max_prompt_len: int = 4096
    thinking: bool = True
    keep_cut: bool = False
    keep_too_long: bool = False
    engine: str = "hf"

    def check(self) -> None:
        """Reject bad flag values, naming the flag."""
        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--max-samples", self.max_samples),
                            ("--num-shards", self.num_shards), ("--part-size", self.part_size),
                            ("--batch-size", self.batch_size), ("--max-prompt-len", self.max_prompt_len)):
            if value is not None and value < 1:
                raise PipelineError(f"{flag} {value}: must be at least 1")
        if not 0 <= self.shard_index < self.num_shards:
            raise PipelineError(f"--shard-index {self.shard_index}: must be in [0, --num-shards {self.num_shards})")
        if not 0.0 <= self.temperature <= 100.0:
            raise PipelineError(f"--temperature {self.temperature}: must be in [0, 100] (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise PipelineError(f"--top-p {self.top_p}: must be in (0, 1]")

    def settings(self) -> dict[str, Any]:
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        out["inputs"] = [str(p) for p in self.inputs]
        return out
