"""Miniature targets: a Kimi-K2.5-shaped checkpoint and an ordinary flat causal LM.

No test may download weights, so the project writes its own targets, deterministic from a
seed. The Kimi-style one has everything that makes the real Kimi-K2.5 awkward for generic
tools: a nested config read through remote code (`trust_remote_code`), weights under
`language_model.*` next to `vision_tower.*`/`mm_projector.*` in several shards, routed experts
stored as compressed-tensors INT4 (pack-quantized, group 32, `quantization_config` in
`text_config`; `kimi-bf16` keeps them bf16), an untied lm_head, Kimi's 163840-token vocabulary with its special tokens at their real ids, and a slow
tiktoken tokenizer with Kimi's chat format. The flat one is a plain Llama with a fast tokenizer
and a ChatML template.

    python -m common.fixtures kimi DIR     # Kimi-style target (routed experts INT4, as Kimi-K2.5)
    python -m common.fixtures kimi-bf16 DIR  # the same with bf16 experts
    python -m common.fixtures flat DIR     # flat target
    python -m common.fixtures kimi         # the cached built-in default (built on first use)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common import miniature_lm
from common.errors import PipelineError
from common.int4_experts import quantize_routed_experts
from common.miniature_lm import LMSettings, corpus_files, render_corpus, train_miniature_lm

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
DEMO_CONVERSATIONS = DATA_DIR / "demo_conversations.jsonl"
KIMI_CODE_DIR = Path(__file__).resolve().parent / "kimi_k25_code"
DEFAULT_CACHE = REPO_ROOT / ".cache" / "targets"
FIXTURE_VERSION = 7  # bump when the generated targets change, so caches are rebuilt

KIMI_VOCAB_SIZE = 163840
KIMI_SPECIAL_TOKENS = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
    163588: "<|im_assistant|>", 163593: "[EOT]", 163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>", 163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>", 163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>",
    163601: "<|im_middle|>", 163602: "<|media_begin|>", 163603: "<|media_content|>",
    163604: "<|media_end|>", 163605: "<|media_pad|>", 163606: "<think>", 163607: "</think>",
    163590: "<|start_header_id|>", 163591: "<|end_header_id|>", 163838: "[UNK]", 163839: "[PAD]",
}
# Added tokens that the real tokenizer config does not mark "special" (decoding with
# skip_special_tokens keeps them: they are part of what the model says).
KIMI_NON_SPECIAL = {"<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"}
# Kimi-K2.5's chat format is a file next to the tokenizer (tokenizer_config.json has none).
KIMI_CHAT_TEMPLATE_FILE = KIMI_CODE_DIR / "chat_template.jinja"

FLAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# ChatML with Qwen3-style reasoning blocks inside the assistant content.
FLAT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{% endif %}"
    "{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% endif %}"
)

BPE_SIZE = 4096
# LM training of each miniature (common/miniature_lm.py) on the ~118K-token demo corpus. The
# Kimi-style one costs ~2.7x more per step (MLA with kv_lora_rank 512, MoE); at one lr for every
# matrix it learned ~1.6x slower per step than a Llama of the same width (MLA's kv_b_proj reads 512
# inputs), and a quarter of its greedy answers looped after 800 steps; lr scaled by 32/fan_in fixes that.
FLAT_LM = LMSettings(steps=600)
KIMI_LM = LMSettings(steps=800, lr_fan_in=32)
# Draft vocabulary of the built-in default run: the miniature's tokenizer has 4096 BPE tokens, so
# the usual 32000 would be mostly ids the data never shows, and it would make CPU training ~10x
# slower (the draft's lm_head and loss scale with it). 2048 covers ~98% of the demo's supervised tokens.
MINIATURE_DRAFT_VOCAB_SIZE = 2048
YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
KIMI_TEXT_CONFIG = {
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": KIMI_VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "q_lora_rank": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
    "v_head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
    "rope_scaling": YARN, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
    "initializer_range": 0.02, "attention_bias": False, "torch_dtype": "bfloat16",
}
KIMI_VISION_CONFIG = {
    "patch_size": 4, "num_attention_heads": 2, "num_hidden_layers": 2, "hidden_size": 16,
    "intermediate_size": 32, "merge_kernel_size": [2, 2], "mm_projector_type": "patchmerger",
    "mm_hidden_size": 64,
}
FLAT_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "initializer_range": 0.02, "torch_dtype": "bfloat16",
}


def demo_corpus(files: list[Path] | None = None) -> list[str]:
    """Every text of the shipped demo conversations (`data/demo_*.jsonl`): contents, reasoning,
    tool-call arguments and tool declarations. The BPE training corpus of both targets."""
    texts = []
    for path in files or corpus_files(DATA_DIR):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            texts += [json.dumps(record["tools"], ensure_ascii=False)] if record.get("tools") else []
            for message in record["messages"]:
                content = message.get("content")
                texts += [content if isinstance(content, str) else "",
                          message.get("reasoning_content") or message.get("reasoning") or ""]
                texts += [_arguments_text(call) for call in message.get("tool_calls") or []]
    return [t for t in texts if t]


def _arguments_text(call: dict) -> str:
    arguments = call.get("function", {}).get("arguments", "")
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def train_byte_bpe(texts: list[str], vocab_size: int, special_tokens: list[str] = ()) -> Tokenizer:
    """A byte-level BPE trained on `texts` (deterministic for a given corpus)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def tiktoken_ranks(tokenizer: Tokenizer) -> str:
    """Convert a byte-level BPE vocabulary to tiktoken's `base64(bytes) rank` lines.

    Merged tokens get ids in merge order, so the id works as tiktoken's merge rank."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return "".join(f"{base64.b64encode(bytes(byte_decoder[c] for c in tok)).decode()} {rank}\n" for tok, rank in vocab)


def _write_shards(state: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    """Save `state` as `num_shards` safetensors files plus the Hugging Face index."""
    keys = list(state)
    per = -(-len(keys) // num_shards)
    weight_map, total = {}, 0
    for s in range(num_shards):
        name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[s * per:(s + 1) * per]}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights. The embedding gets a wide init (0.5) and the other weights a
    small one (0.04), so each layer refines the residual stream instead of scrambling it, as in a
    trained model, and the final state stays predictable from the auxiliary layers."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm.bias"):
            value = torch.ones_like(tensor) if name.endswith("weight") else torch.zeros_like(tensor)
        elif "e_score_correction_bias" in name or name.endswith(".bias"):
            value = torch.zeros_like(tensor)
        else:
            value = torch.randn(tensor.shape, generator=g) * (0.5 if "embed_tokens" in name else 0.04)
        state[name] = value.to(torch.bfloat16)
    return state


def _lm_trained_state(model: torch.nn.Module, tokenizer, settings: LMSettings) -> dict[str, torch.Tensor]:
    """The weights of `model` trained as a small LM on the demo corpus rendered through
    `tokenizer`'s chat template (common/miniature_lm.py), in bf16. A model with random weights
    decodes greedily into a loop, which makes every acceptance length measured on it meaningless."""
    sequences, _ = render_corpus(tokenizer, corpus_files(DATA_DIR))
    if not sequences:
        raise PipelineError(f"no conversation of {DATA_DIR}/demo_*.jsonl renders through the miniature's "
                            "chat template")
    active = _producible_ids(tokenizer) | {t for s in sequences for t in s}
    train_miniature_lm(model, sequences, sorted(active), settings)
    return {name: tensor.detach().to(torch.bfloat16) for name, tensor in model.state_dict().items()}


def _text_state(folder: Path) -> dict[str, torch.Tensor]:
    """The unquantized text weights of a Kimi miniature folder, without the `language_model.` prefix."""
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(Path(folder).glob("model-*.safetensors")):
        state.update({k.removeprefix("language_model."): v for k, v in load_file(shard).items()
                      if k.startswith("language_model.")})
    if any(k.endswith("weight_packed") for k in state):
        raise PipelineError(f"{folder}: its experts are already quantized; expected a kimi-bf16 miniature")
    return state


def _producible_ids(tokenizer) -> set[int]:
    """Every id the tokenizer can produce: its vocabulary (BPE ranks and added tokens)."""
    return {int(i) for i in tokenizer.get_vocab().values()}


def write_kimi_target(out_dir: str | Path, seed: int = 0, int4_experts: bool = True,
                      text_overrides: dict | None = None, num_shards: int = 4,
                      lm_settings: LMSettings | None = None, trained_from: Path | None = None) -> Path:
    """Write the Kimi-K2.5-shaped miniature target into `out_dir`: routed experts stored as
    Kimi-K2.5 stores them (compressed-tensors pack-quantized INT4, group 32), or in bf16 with
    `int4_experts=False` (for exact arithmetic). `text_overrides` changes text_config fields
    (the benchmarks' variant where experts dominate the weights); `lm_settings`: how its LM
    training runs (default KIMI_LM). `trained_from`, a bf16 Kimi miniature written with the same
    arguments, lends its trained text weights instead of training again (the LM training is
    most of the cost; `ensure_target` quantizes the cached bf16 target this way)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from common.kimi_k25_code.configuration_kimi_k25 import KimiK25VisionConfig
    from common.kimi_k25_code.modeling_kimi_k25 import MoonViTStub, PatchMergerProjector

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_config = {**KIMI_TEXT_CONFIG, **(text_overrides or {})}
    for name in ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py", "chat_template.jinja"):
        shutil.copy(KIMI_CODE_DIR / name, out / name)

    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25", "tie_word_embeddings": False,
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "media_placeholder_token_id": 163605, "ignore_index": -100,
        "text_config": text_config, "vision_config": KIMI_VISION_CONFIG,
        "torch_dtype": "bfloat16", "transformers_version": "4.57.6",
    }

    # Tokenizer: a small BPE over the demo corpus, Kimi's specials at their real ids.
    bpe = train_byte_bpe(demo_corpus(), BPE_SIZE)
    (out / "tiktoken.model").write_text(tiktoken_ranks(bpe))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t not in KIMI_NON_SPECIAL}
             for i, t in KIMI_SPECIAL_TOKENS.items()}
    tokenizer_config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "added_tokens_decoder": added, "additional_special_tokens": ["<|im_end|>", "<|im_user|>",
        "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))

    # Weights: the text model under `language_model.`, plus the vision keys of the real checkpoint.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    torch.manual_seed(seed)
    text = DeepseekV3ForCausalLM(DeepseekV3Config(**text_config, attn_implementation="sdpa"))
    trained = (_text_state(trained_from) if trained_from is not None
               else _lm_trained_state(text, tokenizer, replace(lm_settings or KIMI_LM, seed=seed)))
    state = {f"language_model.{k}": v for k, v in trained.items()}
    del text, trained
    if int4_experts:  # a separate step on the finished weights, as a real checkpoint is quantized after training
        state, text_config["quantization_config"] = quantize_routed_experts(state)
    vcfg = KimiK25VisionConfig(**KIMI_VISION_CONFIG)
    for prefix, module in (("vision_tower", MoonViTStub(vcfg)), ("mm_projector", PatchMergerProjector(vcfg))):
        state.update({f"{prefix}.{k}": t for k, t in _random_state(module, seed + 1).items()})
    _write_shards(state, out, num_shards=num_shards)
    (out / "config.json").write_text(json.dumps(config, indent=2))

    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 163584, "eos_token_id": 163586}))
    return out


def write_flat_target(out_dir: str | Path, seed: int = 0, lm_settings: LMSettings | None = None) -> Path:
    """Write the ordinary flat miniature target (Llama, fast tokenizer, ChatML) into `out_dir`
    (`lm_settings`: how its LM training runs; default FLAT_LM)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bpe = train_byte_bpe(demo_corpus(), BPE_SIZE, special_tokens=FLAT_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>", "<think>", "</think>"])
    tokenizer.chat_template = FLAT_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    ids = {t: bpe.token_to_id(t) for t in FLAT_SPECIAL_TOKENS}
    config = LlamaConfig(**{**FLAT_MODEL_CONFIG, "vocab_size": bpe.get_vocab_size(),
                            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                            "pad_token_id": ids["<|endoftext|>"]})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    trained = _lm_trained_state(model, tokenizer, replace(lm_settings or FLAT_LM, seed=seed))
    model.load_state_dict({k: v.float() for k, v in trained.items()})
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="200KB")
    return out


def write_kimi_bf16_target(out_dir: str | Path, seed: int = 0) -> Path:
    """The Kimi-style miniature with its routed experts in bf16 (same weights before quantization)."""
    return write_kimi_target(out_dir, seed=seed, int4_experts=False)


WRITERS = {"kimi": write_kimi_target, "kimi-bf16": write_kimi_bf16_target, "flat": write_flat_target}


def fixture_key() -> str:
    """What a generated target depends on: FIXTURE_VERSION, the fixture code (this module, the LM
    training, Kimi's config/model/tokenizer code) and every demo corpus file, hashed."""
    h = hashlib.sha256(f"v{FIXTURE_VERSION}".encode())
    sources = [Path(__file__), Path(miniature_lm.__file__), *sorted(KIMI_CODE_DIR.glob("*.py")),
               *corpus_files(DATA_DIR)]
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def cached_target_path(kind: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Where the cached target of `kind` lives (complete once it holds config.json)."""
    return cache_dir / f"{kind}-v{FIXTURE_VERSION}-{fixture_key()}"


def ensure_target(kind: str = "kimi", cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The cached miniature target of `kind`, generated on first use (atomically: a complete
    folder appears under its final name or not at all). The folder name carries `fixture_key()`,
    so a change to the code or the corpus makes a new one and a CI run builds each target once."""
    final = cached_target_path(kind, cache_dir)
    if (final / "config.json").exists():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=cache_dir))
    try:
        # The INT4 target is the bf16 one quantized: one LM training serves both.
        WRITERS[kind](tmp, **({"trained_from": ensure_target("kimi-bf16", cache_dir)} if kind == "kimi" else {}))
        os.replace(tmp, final)
    except OSError:  # another process finished first
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_targets(kinds: list[str], cache_dir: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """`ensure_target` of each kind, the missing ones built at the same time, one process each
    (each trains on one thread): on two cores both miniatures take as long as the slower one."""
    missing = [k for k in kinds if not (cached_target_path(k, cache_dir) / "config.json").exists()]
    builds = {k: subprocess.Popen([sys.executable, "-m", "common.fixtures", k, "--cache-dir", str(cache_dir)],
                                  cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for k in missing[1:]}
    paths = {k: ensure_target(k, cache_dir) for k in missing[:1]}  # the first one here, meanwhile
    for kind, proc in builds.items():
        output = proc.communicate()[0]
        if proc.returncode != 0:
            raise PipelineError(f"building the {kind} miniature target failed:\n{output[-3000:]}")
    return {k: paths.get(k) or ensure_target(k, cache_dir) for k in kinds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a miniature target checkpoint (into OUT_DIR, or "
                                     "into the cache that the built-in default run reads when OUT_DIR is omitted).")
    parser.add_argument("kind", choices=sorted(WRITERS))
    parser.add_argument("out_dir", type=Path, nargs="?", default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help="where the cached targets live (without OUT_DIR; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=None,
                        help="LM training steps (default: FLAT_LM / KIMI_LM; fewer make a weaker LM quickly)")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        if args.lm_steps is not None or args.seed != 0:
            parser.error("--lm-steps and --seed need OUT_DIR (the cache holds the default targets only)")
        print(f"the {args.kind} miniature target is cached at {ensure_target(args.kind, args.cache_dir)}")
        return 0
    settings = None
    if args.lm_steps is not None:
        settings = replace({"kimi": KIMI_LM, "flat": FLAT_LM}[args.kind], steps=args.lm_steps)
    out = WRITERS[args.kind](args.out_dir, seed=args.seed, lm_settings=settings)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote the {args.kind} miniature target to {out} ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
