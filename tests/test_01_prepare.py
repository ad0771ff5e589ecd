"""Step 01: readers, loss masks (hand-derived for both miniature targets), bad-input counting,
the prepared folder and the script's error exits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.data.conversations import (
    Conversation,
    Message,
    Rejection,
    ToolCall,
    iter_records,
    resolve_inputs,
    to_conversation,
)
from common.data.loss_mask import TEMPLATE_ERROR, ChatMasker, MaskError
from common.data.prepare import PrepareOptions, prepare, summary_lines, warning_lines
from common.data.prepared_dataset import COLUMNS, PrepareReport, load_prepared
from common.errors import PipelineError
from common.fixtures.targets import FLAT_CHAT_TEMPLATE
from tests.conftest import run_script

# --- loss masks ------------------------------------------------------------------------------

U, A = Message("user", "Hi there"), Message("assistant", "Hello!")
SYS = Message("system", "Be brief.")
A_THINK = Message("assistant", "Hello!", "Greet back.")
U2, A2 = Message("user", "What is 6 × 7? 你好"), Message("assistant", "42.\n\nDone", "Multiply.")
KU, KA = "<|im_user|>user<|im_middle|>", "<|im_assistant|>assistant<|im_middle|>"  # Kimi's role headers
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')
TOOL_TURNS = (Message("user", "Weather in Paris?"), Message("assistant", "", "Need the weather.", tool_calls=(CALL,)),
              Message("tool", '{"temp": 14}', tool_call_id=CALL.id), Message("assistant", "14 °C in Paris.", "Report it."))
IMAGE_RECORD = {"messages": [
    {"role": "user", "content": [{"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": "x"}},
                                 {"type": "text", "text": "this picture?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

# Each case: the conversation, then per target the rendering cut into (text, supervised) pieces,
# written out by hand from the chat formats. Kimi supervises what it generates after its
# generation prompt `<|im_assistant|>assistant<|im_middle|><think>` (a turn without reasoning is
# instant mode: the prompt ends `<think></think>`) through `<|im_end|>`; every turn keeps its
# reasoning (preserve_thinking=True); no default system prompt. ChatML supervises after
# `<|im_start|>assistant\n` through `<|im_end|>` (not the newline after it).
CASES = {
    "single turn": ((U, A), {
        "kimi": [(KU + "Hi there<|im_end|>" + KA + "<think></think>", 0), ("Hello!<|im_end|>", 1)],
        "flat": [("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", 0), ("Hello!<|im_end|>", 1),
                 ("\n", 0)],
    }),
    "system prompt and reasoning": ((SYS, U, A_THINK), {
        "kimi": [("<|im_system|>system<|im_middle|>Be brief.<|im_end|>" + KU + "Hi there<|im_end|>" + KA + "<think>", 0),
                 ("Greet back.</think>Hello!<|im_end|>", 1)],
        "flat": [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                  "<|im_start|>assistant\n", 0), ("<think>\nGreet back.\n</think>\n\nHello!<|im_end|>", 1), ("\n", 0)],
    }),
    # Kimi's template would empty the first turn's think block; preserve_thinking keeps it.
    "multi-turn with reasoning": ((U, A_THINK, U2, A2), {
        "kimi": [(KU + "Hi there<|im_end|>" + KA + "<think>", 0), ("Greet back.</think>Hello!<|im_end|>", 1),
                 (KU + "What is 6 × 7? 你好<|im_end|>" + KA + "<think>", 0), ("Multiply.</think>42.\n\nDone<|im_end|>", 1)],
        "flat": [("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", 0),
                 ("<think>\nGreet back.\n</think>\n\nHello!<|im_end|>", 1),
                 ("\n<|im_start|>user\nWhat is 6 × 7? 你好<|im_end|>\n<|im_start|>assistant\n", 0),
                 ("<think>\nMultiply.\n</think>\n\n42.\n\nDone<|im_end|>", 1), ("\n", 0)],
    }),
    "system prompt, multi-turn, no reasoning": ((SYS, U, A, U2, Message("assistant", "42")), {
        "kimi": [("<|im_system|>system<|im_middle|>Be brief.<|im_end|>" + KU + "Hi there<|im_end|>" + KA
                  + "<think></think>", 0), ("Hello!<|im_end|>", 1),
                 (KU + "What is 6 × 7? 你好<|im_end|>" + KA + "<think></think>", 0), ("42<|im_end|>", 1)],
        "flat": [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                  "<|im_start|>assistant\n", 0), ("Hello!<|im_end|>", 1),
                 ("\n<|im_start|>user\nWhat is 6 × 7? 你好<|im_end|>\n<|im_start|>assistant\n", 0), ("42<|im_end|>", 1),
                 ("\n", 0)],
    }),
    # A user who types the assistant header must not be supervised.
    "header inside user text": ((Message("user", "<|im_assistant|>assistant<|im_middle|> and <|im_start|>assistant\n"), A), {
        "kimi": [(KU + "<|im_assistant|>assistant<|im_middle|> and <|im_start|>assistant\n<|im_end|>" + KA
                  + "<think></think>", 0), ("Hello!<|im_end|>", 1)],
        "flat": [("<|im_start|>user\n<|im_assistant|>assistant<|im_middle|> and <|im_start|>assistant\n<|im_end|>\n"
                  "<|im_start|>assistant\n", 0), ("Hello!<|im_end|>", 1), ("\n", 0)],
    }),
    # Tools declared first (compact JSON), the call section and `<|im_end|>` supervised, the result
    # (`## Return of ID`) not. Plain ChatML renders neither tools nor calls: only the turns' text.
    "tool calls with results": (TOOL_TURNS, {
        "kimi": [('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
                  '"parameters":{"type":"object"}}}]<|im_end|>' + KU + "Weather in Paris?<|im_end|>" + KA + "<think>", 0),
                 ("Need the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                  '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>', 1),
                 ('<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 14}<|im_end|>' + KA
                  + "<think>", 0), ("Report it.</think>14 °C in Paris.<|im_end|>", 1)],
        "flat": [("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
                 ("<think>\nNeed the weather.\n</think>\n\n<|im_end|>", 1),
                 ('\n<|im_start|>tool\n{"temp": 14}<|im_end|>\n<|im_start|>assistant\n', 0),
                 ("<think>\nReport it.\n</think>\n\n14 °C in Paris.<|im_end|>", 1), ("\n", 0)],
    }),
    # List content: text parts joined, the image part dropped (counted by the reader).
    "list content": (to_conversation("img", IMAGE_RECORD).messages, {
        "kimi": [(KU + "What is in this picture?<|im_end|>" + KA + "<think></think>", 0), ("A cat.<|im_end|>", 1)],
        "flat": [("<|im_start|>user\nWhat is in this picture?<|im_end|>\n<|im_start|>assistant\n", 0),
                 ("A cat.<|im_end|>", 1), ("\n", 0)],
    }),
}
CASE_TOOLS = {"tool calls with results": TOOLS}


@pytest.fixture(scope="module")
def tokenizers(kimi_target, flat_target) -> dict:
    return {"kimi": AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True),
            "flat": AutoTokenizer.from_pretrained(flat_target)}


@pytest.fixture(scope="module")
def maskers(tokenizers) -> dict[str, ChatMasker]:
    return {kind: ChatMasker(tok) for kind, tok in tokenizers.items()}


def expected(tokenizer, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Ids and mask from hand-cut pieces, and a check that the pieces tokenize like the whole."""
    ids, mask = [], []
    for text, supervised in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [supervised] * len(piece)
    assert ids == tokenizer.encode("".join(t for t, _ in pieces), add_special_tokens=False)
    return ids, mask


@pytest.mark.parametrize("kind", ["kimi", "flat"])
@pytest.mark.parametrize("case", list(CASES))
def test_mask_matches_hand_derived(maskers, tokenizers, kind, case):
    messages, pieces = CASES[case]
    text, _ = maskers[kind].render_with_spans(messages, CASE_TOOLS.get(case))
    assert text == "".join(t for t, _ in pieces[kind])  # the hand-written rendering is the template's
    encoded = maskers[kind].encode(messages, CASE_TOOLS.get(case))
    ids, mask = expected(tokenizers[kind], pieces[kind])
    assert encoded.input_ids == ids
    assert encoded.loss_mask == mask


@pytest.mark.parametrize("kind", ["kimi", "flat"])
@pytest.mark.parametrize("demo", ["demo_conversations.jsonl", "demo_agentic.jsonl"])
def test_ids_are_the_tokenization_of_the_whole_rendering(maskers, tokenizers, kind, demo, demo_conversations):
    tok, masker = tokenizers[kind], maskers[kind]
    for line in (demo_conversations.parent / demo).read_text(encoding="utf-8").splitlines()[:40]:
        conversation = to_conversation("demo", json.loads(line))
        encoded = masker.encode(conversation.messages, conversation.tools)
        text, spans = encoded.rendering.text, encoded.rendering.spans
        assert encoded.input_ids == tok.encode(text, add_special_tokens=False)
        # The supervised tokens decode to exactly the supervised character spans.
        runs, run = [], []
        for token, m in zip(encoded.input_ids + [None], encoded.loss_mask + [0]):
            if m:
                run.append(token)
            elif run:
                runs.append(tok.decode(run))
                run = []
        assert runs == [text[a:b] for a, b in spans]
        assert len(spans) == sum(m.role == "assistant" for m in conversation.messages)
        assert encoded.rendering.stripped_turns == 0
        # Every turn's reasoning is supervised on both targets.
        assert encoded.rendering.reasoning_turns == sum(m.reasoning is not None for m in conversation.messages)


def test_assistant_header_read_off_the_template(maskers):
    assert maskers["kimi"].header == "<|im_assistant|>assistant<|im_middle|>"
    assert maskers["kimi"].prompts == ("<|im_assistant|>assistant<|im_middle|><think></think>",
                                       "<|im_assistant|>assistant<|im_middle|><think>")
    assert maskers["kimi"].switches == {"preserve_thinking": True} and maskers["kimi"].renders_tool_calls
    assert maskers["flat"].header == "<|im_start|>assistant\n"
    assert maskers["flat"].prompts == ("<|im_start|>assistant\n",)
    assert maskers["flat"].switches == {} and not maskers["flat"].renders_tool_calls
    assert maskers["kimi"].end_of_turn == maskers["flat"].end_of_turn == "<|im_end|>"


def test_reasoning_the_template_drops_is_not_supervised(flat_target):
    """A template that keeps only the last turn's reasoning (as Qwen3's does for earlier turns) and
    has no switch to keep it: the emptied turn is left out and counted, the last one supervised."""
    tok = _variant(flat_target, FLAT_CHAT_TEMPLATE.replace("m.get('reasoning_content') %}",
                                                           "m.get('reasoning_content') and loop.last %}"))
    encoded = ChatMasker(tok).encode((U, A_THINK, U2, A2))
    ids, mask = expected(tok, [("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                                "<|im_start|>user\nWhat is 6 × 7? 你好<|im_end|>\n<|im_start|>assistant\n", 0),
                               ("<think>\nMultiply.\n</think>\n\n42.\n\nDone<|im_end|>", 1), ("\n", 0)])
    assert (encoded.input_ids, encoded.loss_mask) == (ids, mask)
    assert (encoded.rendering.stripped_turns, encoded.rendering.reasoning_turns) == (1, 1)


def test_kimi_template_without_the_switch_empties_history(kimi_target):
    """Kimi's rule itself: without preserve_thinking every turn up to the last assistant turn
    without tool calls has an empty think block, so none of these turns is supervised; the tool-call
    turn after it keeps its reasoning."""
    tok = AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True)
    tok.chat_template = tok.get_chat_template().replace("preserve_thinking", "keep_old_thinking")
    masker = ChatMasker(tok)
    assert masker.switches == {}
    follow_up = (*TOOL_TURNS, Message("user", "And Rome?"),
                 Message("assistant", "", "Same tool.", tool_calls=(ToolCall("functions.get_weather:1", "get_weather",
                                                                             '{"city": "Rome"}'),)))
    rendering = masker.render(follow_up, TOOLS)
    assert (rendering.stripped_turns, rendering.reasoning_turns, len(rendering.spans)) == (2, 1, 1)
    assert rendering.text.count("<think></think>") == 2
    assert rendering.text[slice(*rendering.spans[0])] == (
        "Same tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
        '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')


def _variant(flat_target: Path, template: str | None):
    tok = AutoTokenizer.from_pretrained(flat_target)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("transform, content, rendered", [("trim", "  Hello!  ", "Hello!"), ("upper", "Hello!", "HELLO!")])
def test_templates_that_change_message_text(flat_target, transform, content, rendered):
    """Templates may trim (Llama 3, Gemma) or otherwise change the text; spans are still found."""
    tok = _variant(flat_target, FLAT_CHAT_TEMPLATE.replace("{{ m['content'] }}", f"{{{{ m['content'] | {transform} }}}}"))
    encoded = ChatMasker(tok).encode([Message("user", "hi"), Message("assistant", content)])
    ids, mask = expected(tok, [(f"<|im_start|>user\n{'HI' if transform == 'upper' else 'hi'}<|im_end|>\n"
                                "<|im_start|>assistant\n", 0), (rendered + "<|im_end|>", 1), ("\n", 0)])
    assert (encoded.input_ids, encoded.loss_mask) == (ids, mask)


def test_token_across_the_span_start_is_supervised(maskers, tokenizers):
    """ChatML's header ends in plain text: `\n` and the content's leading spaces share a token."""
    encoded = maskers["flat"].encode([Message("user", "hi"), Message("assistant", "  Hello!")])
    ids, mask = expected(tokenizers["flat"], [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant", 0),
                                              ("\n  Hello!<|im_end|>", 1), ("\n", 0)])
    assert tokenizers["flat"].decode(ids[mask.index(1)]).startswith("\n")  # the straddling token
    assert (encoded.input_ids, encoded.loss_mask) == (ids, mask)


def test_template_errors(flat_target):
    strict = _variant(flat_target, "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('user first') }}{% endif %}"
                      + FLAT_CHAT_TEMPLATE)
    with pytest.raises(MaskError) as e:
        ChatMasker(strict).encode([A, U, A])
    assert e.value.reason == TEMPLATE_ERROR and "user first" in e.value.detail
    with pytest.raises(PipelineError, match="no chat template"):
        ChatMasker(_variant(flat_target, None))


def test_tokenizer_that_does_not_split_special_tokens_is_refused(flat_target):
    tok = AutoTokenizer.from_pretrained(flat_target, split_special_tokens=True)
    with pytest.raises(PipelineError, match="tokenizer_mismatch"):
        ChatMasker(tok)


# --- readers ---------------------------------------------------------------------------------

OPENAI = [
    {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                             {"role": "assistant", "content": "A1", "reasoning_content": "R1"}]},
    {"messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]},
]
SHAREGPT = [{"id": "s", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                                           {"from": "gpt", "value": "A1"}]}]
WANT = [(("system", "S", None), ("user", "Q1", None), ("assistant", "A1", "R1")),
        (("user", "Q2", None), ("assistant", "A2", None))]


def _read(*paths) -> list[Conversation | Rejection]:
    return [to_conversation(sid, record) for sid, record in iter_records(resolve_inputs(paths))]


def _triples(conversation: Conversation) -> tuple:
    return tuple((m.role, m.content, m.reasoning) for m in conversation.messages)


def _write_all_formats(folder: Path) -> dict[str, Path]:
    from datasets import Dataset

    folder.mkdir()
    paths = {"jsonl": folder / "c.jsonl", "json": folder / "c.json", "json_data": folder / "d.json",
             "parquet": folder / "c.parquet", "hf_dataset": folder / "saved"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in OPENAI), encoding="utf-8")
    paths["json"].write_text(json.dumps(OPENAI), encoding="utf-8")
    paths["json_data"].write_text(json.dumps({"data": OPENAI}), encoding="utf-8")
    Dataset.from_list(OPENAI).to_parquet(str(paths["parquet"]))
    Dataset.from_list(OPENAI).save_to_disk(str(paths["hf_dataset"]))
    return paths


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    return _write_all_formats(tmp_path_factory.mktemp("formats") / "inputs")


@pytest.mark.parametrize("fmt", ["jsonl", "json", "json_data", "parquet", "hf_dataset"])
def test_each_format_reads_the_same_conversations(formats, fmt):
    conversations = _read(formats[fmt])
    assert [_triples(c) for c in conversations] == WANT
    assert conversations[0].sample_id == "a"
    # No id: the file and line (JSONL, from 1) or row (from 0).
    assert conversations[1].sample_id == f"{formats[fmt]}:{2 if fmt == 'jsonl' else 1}"


def test_folder_reads_every_file_and_saved_dataset(formats):
    sources = resolve_inputs([formats["jsonl"].parent])
    assert sorted(fmt for _, fmt in sources) == ["hf_dataset", "json", "json", "jsonl", "parquet"]
    assert [_triples(c) for c in _read(formats["jsonl"].parent)] == WANT * 5


def test_saved_dataset_dict_reads_its_splits_in_order(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(OPENAI[1:]), "test": Dataset.from_list(OPENAI[:1])}).save_to_disk(
        str(tmp_path / "dd"))
    conversations = _read(tmp_path / "dd")
    assert [_triples(c) for c in conversations] == WANT
    assert conversations[1].sample_id == f"{tmp_path / 'dd'}/train:0"


def test_sharegpt_form(tmp_path):
    path = tmp_path / "share.jsonl"
    path.write_text(json.dumps(SHAREGPT[0]) + "\n", encoding="utf-8")
    [conversation] = _read(path)
    assert conversation.sample_id == "s"
    assert _triples(conversation) == (("system", "S", None), ("user", "Q1", None), ("assistant", "A1", None))


def test_openai_tool_calls_results_and_list_content():
    record = {"id": "t", "tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "content": None, "reasoning": "Call f.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x":2}'}},
            {"type": "function", "function": {"name": "f", "arguments": "{}"}},  # no id
            {"id": "c4", "type": "function", "function": {"name": "f", "arguments": "x=4"}},  # not JSON
            {"id": "c5", "type": "function", "function": {"arguments": "{}"}}]},  # no function name
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": ""},
        {"role": "assistant", "content": "Done."}]}
    conversation = to_conversation("f:1", record)
    assert conversation.tools == record["tools"] and conversation.media_parts == 1
    assert conversation.skipped_tool_calls == ("no_id", "arguments_not_json", "no_function_name")
    user, call_turn, first, second, answer = conversation.messages
    assert user == Message("user", "Look: ")
    assert call_turn == Message("assistant", "", "Call f.", tool_calls=(
        ToolCall("c1", "f", '{"x": 1}', True), ToolCall("c2", "f", '{"x":2}', False)))
    assert call_turn.to_template()["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # objects stay objects
    assert call_turn.to_template()["tool_calls"][1]["function"]["arguments"] == '{"x":2}'  # strings verbatim
    assert (first, second) == (Message("tool", "one", tool_call_id="c1"), Message("tool", "", tool_call_id="c2"))
    assert answer == Message("assistant", "Done.")
    # A turn whose only calls are malformed is skipped (counted), not the conversation.
    only_bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, {"role": "assistant", "content": "a"}]}
    assert [m.role for m in to_conversation("f:2", only_bad).messages] == ["user", "assistant"]


@pytest.mark.parametrize("call_turn, result_turn", [("function_call", "observation"), ("tool_call", "tool"),
                                                    ("function_call", "function_response")])
def test_sharegpt_function_call_and_observation_turns(call_turn, result_turn):
    record = {"system": "Use tools.", "tools": '[{"name": "weather", "parameters": {}}]', "conversations": [
        {"from": "human", "value": "Weather in Oslo and Rome?"},
        {"from": "gpt", "value": "Checking."},
        {"from": call_turn, "value": '[{"name": "weather", "arguments": {"city": "Oslo"}}, '
                                     '{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]'},
        {"from": result_turn, "value": "-2 C"},
        {"from": result_turn, "value": "18 C"},
        {"from": call_turn, "value": "not json"},
        {"from": "gpt", "value": "Oslo -2 C, Rome 18 C."}]}
    conversation = to_conversation("s:1", record)
    assert conversation.tools == [{"name": "weather", "parameters": {}}]
    assert conversation.skipped_tool_calls == ("arguments_not_json",)
    assert conversation.messages == (
        Message("system", "Use tools."), Message("user", "Weather in Oslo and Rome?"),
        Message("assistant", "Checking.", tool_calls=(ToolCall("functions.weather:0", "weather", '{"city": "Oslo"}', True),
                                                      ToolCall("functions.weather:1", "weather", '{"city": "Rome"}'))),
        Message("tool", "-2 C", tool_call_id="functions.weather:0"),
        Message("tool", "18 C", tool_call_id="functions.weather:1"),
        Message("assistant", "Oslo -2 C, Rome 18 C."))


@pytest.mark.parametrize("record, reason", [
    ("not a dict", "malformed_record"),
    ({"text": "no messages"}, "malformed_record"),
    ({"messages": ["not a dict"]}, "malformed_record"),
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": " \n"}, {"role": "assistant", "content": "y"}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": [{"type": "table"}]}, {"role": "assistant", "content": "y"}]},
     "non_string_content"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}, {"role": "assistant", "content": "y"}]},
     "non_string_content"),
    ({"tools": "{oops", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "malformed_tools"),
    ({"tools": [1], "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "malformed_tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning_content": 3}]},
     "non_string_content"),
])
def test_bad_records_are_rejected_with_a_reason(record, reason):
    result = to_conversation("f:1", record)
    assert isinstance(result, Rejection) and result.reason == reason


def test_input_errors_name_the_path(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{oops")
    (tmp_path / "dict.json").write_text('{"rows": []}')
    (tmp_path / "bad.parquet").write_text("x")
    (tmp_path / "broken_dataset").mkdir()
    (tmp_path / "broken_dataset" / "state.json").write_text("{")
    for path, message in ((tmp_path / "missing.jsonl", "no such file"), (tmp_path / "notes.txt", "unknown format"),
                          (tmp_path / "empty", "unknown format")):
        with pytest.raises(PipelineError, match=message) as e:
            resolve_inputs([path])
        assert str(path) in str(e.value)
    for path in ("bad.json", "dict.json", "bad.parquet", "broken_dataset"):
        with pytest.raises(PipelineError, match=f"{tmp_path / path}: "):
            _read(tmp_path / path)


# --- the stage: counting, truncation, subsets, output -----------------------------------------

def _conv(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


BAD_LINES = [
    json.dumps(_conv("Hi", "Hello!")),
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"messages": [{"role": "user", "content": "x"}]}),
    json.dumps(_conv("", "y")),
    json.dumps({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}),
    json.dumps(_conv("word " * 400, "y")),  # the answer starts after --max-len: nothing left to learn
    json.dumps(_conv("Tell me more.", "more words " * 100)),  # truncated, kept
]


def _prepare(target: Path, inputs: list[Path], output: Path, **kwargs) -> PrepareReport:
    return prepare(PrepareOptions(inputs=inputs, target=target, output=output, trust_remote_code=True, **kwargs))


@pytest.fixture(scope="module")
def bad_run(kimi_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    (folder / "bad.jsonl").write_text("\n".join(BAD_LINES) + "\n", encoding="utf-8")
    report = _prepare(kimi_target, [folder / "bad.jsonl"], folder / "prepared", max_len=128)
    return report, folder / "prepared"


def test_bad_input_is_skipped_and_counted(bad_run):
    report, _ = bad_run
    assert report.dropped == {"empty_content": 1, "malformed_record": 2, "no_assistant_turn": 1,
                              "no_supervised_after_truncation": 1, "non_string_content": 1, "unknown_role": 1}
    assert (report.samples_read, report.samples_kept, report.truncated) == (len(BAD_LINES), 2, 1)
    assert report.drop_examples["unknown_role"].endswith("bad.jsonl:4: role 'robot'")
    lines = warning_lines(report)
    assert len(lines) == len(report.dropped) and all(line.startswith("warning: ") for line in lines)
    assert any("skipped 2 sample(s): malformed_record" in line for line in lines)


AGENTIC_LINES = [
    json.dumps({"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need it.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},  # no id
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "14 C"},
        {"role": "assistant", "content": "14 °C.", "reasoning_content": "Report."}]}),
    json.dumps(IMAGE_RECORD),
    json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "oops"},
                                  {"from": "gpt", "value": "a"}]}),
]


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_report_counts_reasoning_tool_calls_media_and_skips(kind, request, tmp_path):
    path = tmp_path / "agentic.jsonl"
    path.write_text("\n".join(AGENTIC_LINES) + "\n", encoding="utf-8")
    report = _prepare(request.getfixturevalue(f"{kind}_target"), [path], tmp_path / "prepared")
    assert (report.samples_read, report.samples_kept, report.dropped) == (3, 3, {})  # nothing else is lost
    assert (report.supervised_turns, report.reasoning_turns, report.stripped_turns, report.tool_calls) == (4, 2, 0, 1)
    assert report.tool_calls_skipped == {"arguments_not_json": 1, "no_id": 1} and report.media_parts_dropped == 1
    assert report.tool_call_examples["no_id"] == f"{path}:1"
    # ChatML has no place for tool calls: said, not hidden.
    assert report.tool_calls_not_rendered == (kind == "flat")
    assert report.rendering["template_switches"] == ({"preserve_thinking": True} if kind == "kimi" else {})
    assert report.rendering["renders_tool_calls"] == (kind == "kimi")
    assert PrepareReport.load(tmp_path / "prepared") == report
    lines = warning_lines(report)
    assert any("skipped 1 malformed tool call(s): no_id" in line for line in lines)
    assert any("not in the text" in line for line in lines) == (kind == "flat")


def test_truncation_keeps_the_prefix(bad_run, kimi_target, maskers):
    report, folder = bad_run
    ds, _ = load_prepared(folder)
    long = ds[1]
    full = maskers["kimi"].encode(to_conversation("x", json.loads(BAD_LINES[-1])).messages)
    assert len(full.input_ids) > 128 and long["num_tokens"] == 128 == report.max_tokens
    assert long["input_ids"] == full.input_ids[:128] and long["loss_mask"] == full.loss_mask[:128]


def test_prepared_folder_matches_the_masker(demo_conversations, kimi_target, maskers, tmp_path):
    report = _prepare(kimi_target, [demo_conversations], tmp_path / "prepared", max_samples=40, seed=3)
    ds, loaded = load_prepared(tmp_path / "prepared")
    assert loaded == report and list(ds.column_names) == list(COLUMNS)
    assert len(ds) == report.samples_kept == 40 and report.not_selected == report.samples_read - 40
    by_id = {c.sample_id: c for c in _read(demo_conversations)}
    for row in ds.select(range(5)):
        encoded = maskers["kimi"].encode(by_id[row["sample_id"]].messages)
        assert (row["input_ids"], row["loss_mask"]) == (encoded.input_ids, encoded.loss_mask)
        assert row["num_tokens"] == len(row["input_ids"])
    assert report.total_tokens == sum(ds["num_tokens"])
    assert report.supervised_tokens == sum(sum(m) for m in ds["loss_mask"])
    # Same seed, same subset, however many workers; another seed, another subset.
    again = _prepare(kimi_target, [demo_conversations], tmp_path / "again", max_samples=40, seed=3, num_proc=2)
    assert load_prepared(tmp_path / "again")[0].to_dict() == ds.to_dict() and again.dropped == report.dropped
    _prepare(kimi_target, [demo_conversations], tmp_path / "other", max_samples=40, seed=4)
    assert load_prepared(tmp_path / "other")[0]["sample_id"] != ds["sample_id"]


def test_bad_flag_values(kimi_target, demo_conversations, tmp_path):
    for flag, kwargs in (("--max-len", {"max_len": 0}), ("--num-proc", {"num_proc": 0}),
                         ("--max-samples", {"max_samples": 0})):
        with pytest.raises(PipelineError, match=flag):
            _prepare(kimi_target, [demo_conversations], tmp_path / "out", **kwargs)


def test_demo_agentic_data_is_clean_and_agentic(demo_conversations):
    """Every call well formed and answered, contents plain strings (renderable by any template), and
    a realistic share of tool use and reasoning."""
    lines = (demo_conversations.parent / "demo_agentic.jsonl").read_text(encoding="utf-8").splitlines()
    conversations = [to_conversation(str(i), json.loads(line)) for i, line in enumerate(lines)]
    assert all(isinstance(c, Conversation) and not c.skipped_tool_calls for c in conversations)
    assert all(isinstance(m["content"], str) for line in lines for m in json.loads(line)["messages"])
    with_tools = [c for c in conversations if any(m.tool_calls for m in c.messages)]
    for c in with_tools:
        calls = [call.id for m in c.messages for call in m.tool_calls]
        assert [m.tool_call_id for m in c.messages if m.role == "tool"] == calls
        assert {call.name for m in c.messages for call in m.tool_calls} <= {t["function"]["name"] for t in c.tools}
    assert 0.4 <= len(with_tools) / len(conversations) <= 0.7
    assert all(any(m.reasoning for m in c.messages) for c in conversations)


# --- the script --------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_writes_folder_and_report(kimi_target, demo_conversations, tmp_path):
    out = tmp_path / "run" / "prepared"
    proc = run_script("01_prepare_data.py", "--input", demo_conversations, "--target", kimi_target,
                      "--trust-remote-code", "--run-dir", tmp_path / "run", "--max-len", "256")
    ds, report = load_prepared(out)
    assert report.samples_read == report.samples_kept + sum(report.dropped.values()) + report.not_selected == 400
    assert report.samples_kept == len(ds) and report.max_tokens <= 256 == report.max_len
    assert sum(n == 256 for n in ds["num_tokens"]) >= report.truncated > 0
    assert 0 < report.supervised_share < 1 and report.chat_template_sha256 and report.tokenizer == "TikTokenTokenizer"
    assert all(max(ids) < report.vocab_size for ids in ds["input_ids"])
    for line in summary_lines(report, out):
        assert line in proc.stdout
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]  # scratch removed


@pytest.mark.slow
@pytest.mark.parametrize("make, reason", [
    (lambda d: d / "missing.jsonl", "no such file"),
    (lambda d: (d / "chats.txt").write_text("x") and d / "chats.txt", "unknown format"),
    (lambda d: (d / "junk.jsonl").write_text("{bad\n[1]\n") and d / "junk.jsonl", "no usable conversation"),
])
def test_cli_errors_name_the_file(kimi_target, tmp_path, make, reason):
    path = make(tmp_path)
    proc = run_script("01_prepare_data.py", "--input", path, "--target", kimi_target, "--trust-remote-code",
                      "--output", tmp_path / "out", check=False)
    assert proc.returncode == 1
    assert "error: " in proc.stderr and str(path) in proc.stderr and reason in proc.stderr
    assert not (tmp_path / "out").exists()
