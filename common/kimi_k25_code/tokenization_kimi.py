"""Kimi-style tiktoken tokenizer of the miniature target (written by this project).

Like moonshotai/Kimi-K2.5's `TikTokenTokenizer`, it is a *slow* `PreTrainedTokenizer` (no
offset mapping) loaded with `trust_remote_code`, built on a tiktoken BPE file
(`tiktoken.model`: one `base64(token_bytes) rank` per line) and Kimi's pre-tokenizer regex.
Special tokens sit at Kimi's real ids (163584 and up), declared in `tokenizer_config.json`'s
`added_tokens_decoder`; the chat template is the file `chat_template.jinja` next to it, which
transformers loads for any tokenizer class. The miniature's BPE is small, so its regular ids stay far below 163584.
"""

import base64
from pathlib import Path

import tiktoken
from transformers import PreTrainedTokenizer

PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, kept here because transformers 5
    moved it out of `transformers.models.gpt2.tokenization_gpt2` (the vLLM side runs 5.x).
    Printable Latin-1 bytes map to themselves; the rest to code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    special_tokens_start = 163584
    num_reserved_special_tokens = 256

    def __init__(self, vocab_file: str, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                 pad_token="[PAD]", added_tokens_decoder=None, **kwargs):
        self.vocab_file = vocab_file
        mergeable_ranks = load_ranks(vocab_file)
        names = {int(i): (t.content if hasattr(t, "content") else t["content"])
                 for i, t in (added_tokens_decoder or {}).items()}
        start, count = self.special_tokens_start, self.num_reserved_special_tokens
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(start, start + count)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PAT_STR,
                                       mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens)
        byte_encoder = bytes_to_unicode()
        self.encoder = {"".join(byte_encoder[b] for b in token): rank for token, rank in mergeable_ranks.items()}
        self.decoder = {rank: token for token, rank in self.encoder.items()}
        self.byte_decoder = {c: b for b, c in byte_encoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.special_tokens_start + self.num_reserved_special_tokens

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self.special_tokens}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # Special tokens were already split off by the base class; encode the rest as plain text.
        return [self.decoder[t] for t in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.special_tokens.get(token, self.special_tokens[str(self.unk_token)]))

    def _convert_id_to_token(self, index: int) -> str:
        if index in self.decoder:
            return self.decoder[index]
        return {i: t for t, i in self.special_tokens.items()}.get(index, str(self.unk_token))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = bytearray()
        for token in tokens:
            if token in self.special_tokens:
                data.extend(token.encode("utf-8"))
            else:
                data.extend(self.byte_decoder[c] for c in token)
        return data.decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                spaces_between_special_tokens: bool = False, **kwargs) -> str:
        # Byte-exact like tiktoken: no space around added tokens (`<think>` is not "special", so
        # the base class would otherwise pad it with spaces).
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                               spaces_between_special_tokens=False, **kwargs)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}tiktoken.model"
        if Path(self.vocab_file).resolve() != out.resolve():
            out.write_text(Path(self.vocab_file).read_text())
        return (str(out),)
