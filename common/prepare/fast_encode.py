"""The target tokenizer's fastest call that gives the ids of `tokenizer.encode(text, add_special_tokens=False)`.

Kimi-K2.5's tokenizer is a slow `PreTrainedTokenizer` with its own `encode(text)` that, called
without keyword arguments, goes straight to tiktoken with special tokens allowed; any keyword
argument sends it down the base class's Python path (split on added tokens, one lookup per
token), about 14x slower. A fast tokenizer's Python wrapper costs a little per call; its Rust
backend does not. Neither shortcut is trusted on faith: at start-up each is compared with the
reference call on probe texts (ordinary text, and every added token and marker-like vocabulary
entry inside text, with spaces and neighbours). A shortcut that differs on ordinary text is not
used; a marker it encodes differently (a tiktoken special that the tokenizer does not declare as
an added token, so the base class reads it as text) sends the texts that contain it down the
reference path, so the ids are the reference's for every text.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

__all__ = ["FastEncoder", "literal_pattern"]

REFERENCE = "reference"  # tokenizer.encode(text, add_special_tokens=False)
OWN_ENCODE = "own_encode"  # a slow tokenizer's own encode(text) (Kimi: tiktoken, special tokens allowed)
BACKEND = "backend"  # a fast tokenizer's Rust backend
PATHS = {REFERENCE: "tokenizer.encode(text, add_special_tokens=False)",
         OWN_ENCODE: "tokenizer.encode(text), the tokenizer's own fast path",
         BACKEND: "tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)"}

# Vocabulary entries that look like control markers (`<|reserved_token_7|>`, `<think>`, `[EOS]`):
# the strings a shortcut may treat as special when the reference does not.
MARKER_RE = re.compile(r"<[^<>\s]{1,80}>|\[[^\[\]\s]{1,80}\]")
ORDINARY = ("Hello, world! It's 12,345.67 - don't stop; we'll see.\n\n", "  leading and trailing  \n",
            "tabs\tand\r\nwindows lines\n\n\n   \n", "ünïcödé naïve café, 你好世界，日本語のテキスト 🙂👍🏽 \u200b",
            "def f(x):\n    return {'a': [1, 2, 3]}  # code\n", " " * 40 + "x" * 60 + "\n" * 5,
            "<not a token> [nor this] <|almost_im_end| <|im_end", "")


class FastEncoder:
    """`encoder(text)`: the reference ids, through the fastest call verified to give them."""

    def __init__(self, tokenizer, probes: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.path, self.diverging, self._reference_re = REFERENCE, [], None
        candidate = _candidate(tokenizer)
        if candidate != REFERENCE and self._agrees(candidate, (*ORDINARY, *probes)):
            self.path = candidate
            self.diverging = sorted(self._diverging_markers())
            if self.diverging:
                self._reference_re = re.compile(literal_pattern(self.diverging))

    def __call__(self, text: str) -> list[int]:
        if self.path == REFERENCE or (self._reference_re is not None and self._reference_re.search(text)):
            return self.reference(text)
        return self._encode(self.path, text)

    def reference(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def describe(self) -> str:
        """The call in use (the report's `rendering.token_ids`)."""
        if self._reference_re is None:
            return PATHS[self.path]
        return (f"{PATHS[self.path]}; a text holding one of {len(self.diverging):,} markers it encodes otherwise "
                f"(e.g. {self.diverging[0]}) through {PATHS[REFERENCE]}")

    # --- choosing ---------------------------------------------------------------------------

    def _encode(self, path: str, text: str) -> list[int]:
        if path == OWN_ENCODE:
            return self.tokenizer.encode(text)
        if path == BACKEND:
            return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        return self.reference(text)

    def _agrees(self, path: str, texts) -> bool:
        try:
            return all(self._encode(path, t) == self.reference(t) for t in texts)
        except Exception:  # noqa: BLE001 - a shortcut that fails on plain text (or returns no list) is not used
            return False

    def _diverging_markers(self) -> set[str]:
        """The markers whose texts the shortcut encodes unlike the reference (tried all at once first)."""
        markers = {t.content for t in self.tokenizer.added_tokens_decoder.values()}
        markers |= {token for token in self.tokenizer.get_vocab() if MARKER_RE.fullmatch(token)}
        contexts = {m: f"a {m} b{m}{m}\n{m}" for m in sorted(markers)}
        if self._agrees(self.path, ("".join(contexts.values()),)):
            return set()
        return {m for m, text in contexts.items() if not self._agrees(self.path, (text,))}


def literal_pattern(words) -> str:
    """A regex matching any of `words`, the longest where several start at one place, factored by
    common prefixes: Kimi's hundreds of `<|reserved_token_N|>` are then a few character tests at
    each `<` of a text, not one per word (a plain alternation made this check a quarter of the
    encode's time). An empty pattern for no words: use `or "(?!)"` to match nothing."""
    trie: dict = {}
    for word in filter(None, words):  # an empty word would match everywhere
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:  # a word ends here, longer ones go on
            return f"(?:{body})?"
        return body

    return pattern(trie)


def _candidate(tokenizer) -> str:
    if tokenizer.is_fast:
        return BACKEND
    if type(tokenizer).encode is not PreTrainedTokenizerBase.encode:
        return OWN_ENCODE
    return REFERENCE
