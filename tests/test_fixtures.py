"""The miniature targets look like what they imitate, and common/target/config.py reads both."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from common import defaults
from common.defaults import DATA_DIR, demo_inputs, fixture_key
from common.evaluate.decoding import distinct_ratio, longest_run
from common.fixtures.miniature_lm import LMSettings, _param_groups, greedy_continuations
from common.fixtures.targets import (
    DEMO_CONVERSATIONS,
    FLAT_LM,
    KIMI_LM,
    KIMI_NON_SPECIAL,
    KIMI_SPECIAL_TOKENS,
    KIMI_TEXT_CONFIG,
    ensure_target,
    main,
    write_kimi_target,
)
from common.target.config import TargetError, load_target_info, read_tensors, weight_map
from common.target.int4_experts import PACKED_PARAMS
from common.target.model import load_text_model


def test_kimi_config_is_nested_like_the_real_one(kimi_target):
    raw = json.loads((kimi_target / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["tie_word_embeddings"] is False
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert raw["auto_map"]["AutoConfig"] == "configuration_kimi_k25.KimiK25Config"
    text = raw["text_config"]
    assert text["model_type"] == "kimi_k2" and text["vocab_size"] == 163840
    assert text["num_hidden_layers"] >= 8 and text["first_k_dense_replace"] == 1
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_theta"] == 50000.0
    assert {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"} <= set(text)
    assert "vision_config" in raw and "hidden_size" not in raw

    config = AutoConfig.from_pretrained(kimi_target, trust_remote_code=True)
    assert type(config).__name__ == "KimiK25Config"
    assert not hasattr(config, "hidden_size")  # the trap for generic tools
    assert config.text_config.hidden_size == text["hidden_size"]
    assert type(config.vision_config).__name__ == "KimiK25VisionConfig"
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(kimi_target, trust_remote_code=False)


def test_kimi_weights_use_real_key_names_and_load_into_deepseek_v3(kimi_target):
    wmap = weight_map(kimi_target)
    shards = set(wmap.values())
    assert len(shards) > 1 and all((kimi_target / s).is_file() for s in shards)
    assert {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
            "language_model.model.norm.weight"} <= set(wmap)
    assert any(k.startswith("language_model.model.layers.7.") for k in wmap)
    assert any(k.startswith("vision_tower.") for k in wmap) and any(k.startswith("mm_projector.") for k in wmap)
    assert not any(k.startswith("model.") or k == "lm_head.weight" for k in wmap)

    text = {k.removeprefix("language_model."): v
            for k, v in read_tensors(kimi_target, [k for k in wmap if k.startswith("language_model.")]).items()}
    config = AutoConfig.from_pretrained(kimi_target, trust_remote_code=True).text_config
    # Routed experts are stored as Kimi-K2.5 stores them (INT4 packed), everything else loads as is.
    packed = {k for k in text if k.endswith(PACKED_PARAMS)}
    experts = {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj" for layer in range(1, config.num_hidden_layers)
               for e in range(config.n_routed_experts) for p in ("gate", "up", "down")}
    assert packed == {f"{m}.{p}" for m in experts for p in PACKED_PARAMS}
    model = DeepseekV3ForCausalLM(config)
    result = model.load_state_dict({k: v for k, v in text.items() if k not in packed}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) == {f"{m}.weight" for m in experts}
    # layer 0 dense, MoE after it
    assert hasattr(model.model.layers[0].mlp, "gate_proj") and hasattr(model.model.layers[1].mlp, "experts")
    assert not torch.equal(text["lm_head.weight"], text["model.embed_tokens.weight"])  # untied


def test_kimi_target_is_deterministic(kimi_target, tmp_path):
    """Two writes give the same weights (a short LM training: the full one is the cached target)."""
    quick = LMSettings(steps=2, batch_size=2, seq_len=64)
    first, again = (write_kimi_target(tmp_path / name, lm_settings=quick) for name in ("first", "again"))
    name = "language_model.model.layers.3.self_attn.q_a_proj.weight"
    assert torch.equal(read_tensors(first, [name])[name], read_tensors(again, [name])[name])
    assert not torch.equal(read_tensors(first, [name])[name], read_tensors(kimi_target, [name])[name])
    assert (kimi_target / "tiktoken.model").read_text() == (again / "tiktoken.model").read_text()


def test_cache_key_follows_the_corpus(tmp_path, monkeypatch):
    key = fixture_key()
    for path in demo_inputs(DATA_DIR):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(defaults, "DATA_DIR", tmp_path)
    assert fixture_key() == key
    (tmp_path / "demo_more.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert fixture_key() != key


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_targets_write_text_not_loops(kind, request):
    """Trained as small LMs on the demo corpus, the miniatures continue held-out-style prompts with
    corpus-like text: at least 90% of greedy continuations repeat no token more than 4 times in
    a row, and their distinct-token ratio is at least 0.5 (a random network loops on one token)."""
    path = request.getfixturevalue(f"{kind}_target")
    info = load_target_info(path, trust_remote_code=True)
    model = load_text_model(info, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    records = [json.loads(line) for line in DEMO_CONVERSATIONS.read_text().splitlines()][-12:]
    prompts = []
    for record in records:  # each conversation up to its last assistant turn
        last = max(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")
        prompts.append(tok.apply_chat_template(record["messages"][:last], add_generation_prompt=True, tokenize=True))
    generations = greedy_continuations(model, prompts, 48, info.stop_ids)
    looping = sum(longest_run(g) > 4 for g in generations) / len(generations)
    distinct = sum(distinct_ratio(g) for g in generations) / len(generations)
    assert looping <= 0.1 and distinct >= 0.5, (looping, distinct, [tok.decode(g) for g in generations[:3]])


def test_kimi_tokenizer_is_slow_with_real_special_ids_and_chat_format(kimi_target):
    tok = AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True)
    assert not tok.is_fast and type(tok).__name__ == "TikTokenTokenizer"
    for i, name in KIMI_SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(name) == i
    with pytest.raises(NotImplementedError):
        tok("hello", return_offsets_mapping=True)

    text = "Hello world, 你好世界! 12345"
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < 163584 and tok.decode(ids) == text

    # Kimi-K2.5's facts: think and tool-call tokens are added but not special; header ids; eos.
    assert {t.content for t in tok.added_tokens_decoder.values() if not t.special} == KIMI_NON_SPECIAL
    assert tok.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>"]) == [163590, 163591]
    assert tok.decode(tok.encode("<think>a</think>b<|im_end|>", add_special_tokens=False),
                      skip_special_tokens=True) == "<think>a</think>b"
    assert json.loads((kimi_target / "config.json").read_text())["eos_token_id"] == 163586
    # The chat template is a file next to the tokenizer, not part of tokenizer_config.json.
    assert "chat_template" not in json.loads((kimi_target / "tokenizer_config.json").read_text())
    assert tok.get_chat_template() == (kimi_target / "chat_template.jinja").read_text()

    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye.", "reasoning_content": "Say bye."}]
    # No default system prompt; every turn up to the last assistant turn without tool calls (here:
    # all) has an empty think block, unless preserve_thinking=True.
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Goodbye.<|im_end|>")
    assert tok.apply_chat_template(msgs, tokenize=False, preserve_thinking=True) == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Greet back.</think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Say bye.</think>Goodbye.<|im_end|>")
    # Turns after the last assistant turn without tool calls keep their reasoning; names; list content.
    agent = [{"role": "system", "content": "Be brief.", "name": "policy"},
             {"role": "user", "content": [{"type": "text", "text": "See "}, {"type": "image_url", "image_url": {}}]},
             {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
                 {"id": "functions.search:0", "type": "function",
                  "function": {"name": "search", "arguments": {"q": "cat"}}}]},
             {"role": "tool", "tool_call_id": "functions.search:0", "content": "a cat"}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    assert tok.apply_chat_template(agent, tools=tools, tokenize=False, add_generation_prompt=True) == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"search",'
        '"parameters":{"type":"object"}}}]<|im_end|>'
        "<|im_system|>policy<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>See <|media_begin|>image<|media_content|><|media_pad|><|media_end|><|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Look it up.</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"q": "cat"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.search:0\na cat<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, thinking=False) == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>")
    assert not rendered.startswith("[BOS]") and tok.encode(rendered, add_special_tokens=False)[0] == 163587


def test_flat_target_is_an_ordinary_causal_lm(flat_target):
    config = AutoConfig.from_pretrained(flat_target)
    assert config.model_type == "llama" and config.num_hidden_layers >= 8 and config.hidden_size == 64
    tok = AutoTokenizer.from_pretrained(flat_target)
    assert tok.is_fast and config.vocab_size == len(tok)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "hm"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nYo<|im_end|>\n")
    assert all(k.startswith(("model.", "lm_head.")) for k in weight_map(flat_target))


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_target_info_and_text_model(kind, request):
    path = request.getfixturevalue(f"{kind}_target")
    info = load_target_info(path, trust_remote_code=True)
    assert info.hidden_size == 64 and info.num_layers == 8 and info.default_layer_ids() == [2, 4, 5]
    assert info.nested == (kind == "kimi")
    assert info.text_architecture == ("DeepseekV3ForCausalLM" if kind == "kimi" else "LlamaForCausalLM")
    model = load_text_model(info, dtype=torch.float32)
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], info.vocab_size)
    assert len(out.hidden_states) == info.num_layers + 1
    if kind == "kimi":  # like a trained model, it predicts ids its tokenizer makes, not one of 160K unused ids
        n_bpe = len((path / "tiktoken.model").read_text().splitlines())
        pred = out.logits.argmax(-1)
        assert ((pred < n_bpe) | (pred >= 163584)).all()


def test_target_errors_name_the_folder(tmp_path, kimi_target):
    with pytest.raises(TargetError, match=str(tmp_path / "nope")):
        load_target_info(tmp_path / "nope", trust_remote_code=True)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((kimi_target / "config.json").read_text())
    for name in ("configuration_kimi_k25.py",):
        (no_weights / name).write_text((kimi_target / name).read_text())
    info = load_target_info(no_weights, trust_remote_code=True)
    with pytest.raises(TargetError, match="no weights"):
        load_text_model(info)
    not_lm = tmp_path / "not_lm"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 8}))
    with pytest.raises(TargetError, match="not a causal language model"):
        load_target_info(not_lm, trust_remote_code=True)
    with pytest.raises(TargetError, match="trust-remote-code"):
        load_target_info(kimi_target, trust_remote_code=False)


def test_fixtures_command_line(tmp_path, capsys, flat_target):
    assert main(["flat", str(tmp_path / "flat"), "--lm-steps", "2"]) == 0
    assert "wrote the flat miniature target" in capsys.readouterr().out
    assert (tmp_path / "flat" / "tokenizer.json").is_file()
    # Without OUT_DIR: the cached built-in target (built by the session fixture already), its path printed.
    assert main(["flat"]) == 0
    assert capsys.readouterr().out.strip() == f"the flat miniature target is cached at {ensure_target('flat')}"
    with pytest.raises(SystemExit):
        main(["flat", "--lm-steps", "2"])
    assert "--lm-steps and --seed need OUT_DIR" in capsys.readouterr().err


def test_lm_training_scales_the_lr_of_wide_input_matrices():
    """MLA's kv_b_proj reads the 512-wide compressed KV: with KIMI_LM's lr_fan_in it learns at
    32/512 of the lr, the matrices reading the 64-wide hidden state at half, q_b_proj (32 inputs) at
    the full lr, and norms at the full lr without weight decay; without lr_fan_in one lr serves all."""
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**KIMI_TEXT_CONFIG, "vocab_size": 1000, "pad_token_id": None}))
    named = dict(model.named_parameters())
    params = list(named.values())

    def scale_of(name: str, groups: list[dict]) -> tuple[float, float]:
        group = next(g for g in groups if any(p is named[name] for p in g["params"]))
        return group["lr_scale"], group["weight_decay"]

    groups = _param_groups(params, KIMI_LM)
    assert KIMI_LM.lr_fan_in == 32
    assert scale_of("model.layers.1.self_attn.kv_b_proj.weight", groups) == (32 / 512, KIMI_LM.weight_decay)
    assert scale_of("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", groups) == (0.5, KIMI_LM.weight_decay)
    assert scale_of("model.embed_tokens.weight", groups) == (0.5, KIMI_LM.weight_decay)
    assert scale_of("model.layers.1.self_attn.q_b_proj.weight", groups) == (1.0, KIMI_LM.weight_decay)
    assert scale_of("model.layers.1.self_attn.kv_a_layernorm.weight", groups) == (1.0, 0.0)
    assert sorted(p for g in groups for p in map(id, g["params"])) == sorted(map(id, params))  # each once
    plain = _param_groups(params, FLAT_LM)
    assert [(g["lr_scale"], g["weight_decay"]) for g in plain] == [(1.0, FLAT_LM.weight_decay), (1.0, 0.0)]
