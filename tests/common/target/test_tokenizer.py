"""common/target/tokenizer.py: the target's tokenizer, its errors naming the folder."""

from __future__ import annotations

import pytest

from common.errors import PipelineError
from common.target.tokenizer import load_tokenizer


def test_loads_both_kinds(kimi_target, flat_target):
    kimi = load_tokenizer(kimi_target, True)
    assert type(kimi).__name__ == "TikTokenTokenizer" and not kimi.is_fast
    assert load_tokenizer(flat_target, False).is_fast


def test_remote_code_tokenizer_needs_the_flag(kimi_target):
    with pytest.raises(PipelineError, match=f"target {kimi_target}: its tokenizer is remote code"):
        load_tokenizer(kimi_target, False)


def test_a_folder_without_a_tokenizer_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(PipelineError, match=f"target {tmp_path}: cannot load its tokenizer"):
        load_tokenizer(tmp_path, False)
