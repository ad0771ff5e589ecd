"""common/prepare/fast_encode.py: the shortcut each miniature tokenizer gets, its ids against the
reference call, markers it reads otherwise routed to the reference, and shortcuts refused."""

from __future__ import annotations

import pytest

from common.prepare.fast_encode import BACKEND, ORDINARY, OWN_ENCODE, REFERENCE, FastEncoder

SPECIAL_TEXTS = ("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>",
                 " <|im_end|> <|im_end|><|im_end|>\n<think></think>", "<|im_start|>assistant\n<|endoftext|>")


@pytest.mark.parametrize("kind, path", [("kimi", OWN_ENCODE), ("flat", BACKEND)])
def test_each_miniature_gets_its_shortcut_with_the_reference_ids(tokenizers, kind, path):
    tok = tokenizers[kind]
    encoder = FastEncoder(tok)
    assert encoder.path == path
    for text in (*ORDINARY, *SPECIAL_TEXTS):
        assert encoder(text) == tok.encode(text, add_special_tokens=False)


def test_tiktoken_specials_the_tokenizer_does_not_declare_take_the_reference_path(tokenizers):
    """The miniature's tiktoken knows all 256 reserved ids, its tokenizer_config declares 23 as added
    tokens: `encode(text)` makes `<|reserved_token_163700|>` one id, the base class plain text."""
    tok = tokenizers["kimi"]
    text = "see <|reserved_token_163700|> here"
    assert 163700 in tok.encode(text) and 163700 not in tok.encode(text, add_special_tokens=False)
    encoder = FastEncoder(tok)
    assert "<|reserved_token_163700|>" in encoder.diverging and "<|im_end|>" not in encoder.diverging
    assert len(encoder.diverging) == 256 - 23
    assert encoder(text) == tok.encode(text, add_special_tokens=False)
    assert "233 markers" in encoder.describe()


def test_a_shortcut_that_differs_on_plain_text_is_not_used(tokenizers, kimi_target):
    """A slow tokenizer whose own encode(text) adds a BOS is not the reference: every text takes it."""
    base = type(tokenizers["kimi"])

    class AddsBos(base):
        def encode(self, text, **kwargs):
            return super().encode(text, **kwargs) if kwargs else [self.bos_token_id, *super().encode(text)]

    tok = AddsBos.from_pretrained(kimi_target)
    encoder = FastEncoder(tok)
    assert encoder.path == REFERENCE and encoder.describe() == "tokenizer.encode(text, add_special_tokens=False)"
    assert encoder("Hello <|im_end|>") == tok.encode("Hello <|im_end|>", add_special_tokens=False)
    assert encoder("Hello")[0] != tok.bos_token_id
