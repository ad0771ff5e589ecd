"""Loading a target's tokenizer (once per process: the stages pass it on)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from common.errors import PipelineError


def load_tokenizer(target: Path, trust_remote_code: bool):
    """The target's tokenizer, loaded once; errors name the folder."""
    try:
        return AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a folder it cannot read
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise PipelineError(f"target {target}: its tokenizer is remote code; pass --trust-remote-code") from e
        raise PipelineError(f"target {target}: cannot load its tokenizer: {type(e).__name__}: {e}") from e
