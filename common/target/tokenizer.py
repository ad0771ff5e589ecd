"""Loading a target's tokenizer (once per process: the stages pass it on)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from common.errors import PipelineError


def load_tokenizer(target: Path, trust_remote_code: bool):
    """The target's tokenizer, loaded once; errors name the folder."""
    try:
        return AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise PipelineError(f"target {target}: its tokenizer is remote code; pass --trust-remote-code") from e
        raise PipelineError(f"target {target}: cannot load its tokenizer: {e}") from e
    except OSError as e:
        raise PipelineError(f"target {target}: cannot load its tokenizer: {e}") from e
