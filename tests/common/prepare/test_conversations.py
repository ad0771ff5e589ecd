"""common/prepare/conversations.py: the OpenAI and ShareGPT forms with tool calls, list content and
media, inline reasoning, bad records (a reason each) and the result of a skipped tool call."""

from __future__ import annotations

import json

import pytest

from common.prepare.conversations import Conversation, Message, Rejection, ToolCall, to_conversation
from common.prepare.readers import iter_records, resolve_inputs

SHAREGPT = [{"id": "s", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                                           {"from": "gpt", "value": "A1"}]}]


def _read(*paths) -> list[Conversation | Rejection]:
    return [to_conversation(sid, record) for sid, record in iter_records(resolve_inputs(paths))]


def _triples(conversation: Conversation) -> tuple:
    return tuple((m.role, m.content, m.reasoning) for m in conversation.messages)


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


def test_inline_reasoning_becomes_the_turns_reasoning():
    """DeepSeek-R1-style answers write their reasoning as `<think>...</think>` before the content;
    it becomes the turn's reasoning (the target's template renders it its own way). A reasoning
    field wins; text that only mentions the tag, or opens a block it never closes, is content."""
    def answer(message: dict) -> Message:
        return to_conversation("f:1", {"messages": [{"role": "user", "content": "q"}, message]}).messages[-1]

    assert answer({"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}) == \
        Message("assistant", "4", "Add them.")
    assert answer({"role": "assistant", "content": "<think></think>4"}) == Message("assistant", "4")
    assert answer({"role": "assistant", "content": "<think>only thinking</think>"}) == \
        Message("assistant", "", "only thinking")
    assert answer({"role": "assistant", "content": "<think>a</think>4", "reasoning_content": "b"}) == \
        Message("assistant", "<think>a</think>4", "b")
    for text in ("Close it with </think>.", "<think>never closed"):
        assert answer({"role": "assistant", "content": text}) == Message("assistant", text)
    sharegpt = to_conversation("s:1", {"conversations": [{"from": "human", "value": "q"},
                                                         {"from": "gpt", "value": "<think>x</think>y"}]})
    assert sharegpt.messages[-1] == Message("assistant", "y", "x")


def test_an_empty_system_message_is_left_out_not_the_conversation():
    """As a top-level empty `system` is: nothing of the conversation is lost."""
    for record in ({"messages": [{"role": "system", "content": " "}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}]},
                   {"system": "", "conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "q"},
                                                    {"from": "gpt", "value": "a"}]}):
        assert to_conversation("f:1", record).messages == (Message("user", "q"), Message("assistant", "a"))


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


# --- the result of a skipped tool call ----------------------------------------------------

CALL_TURNS = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c1", "function": {"name": "get", "arguments": "{not json"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
              {"role": "assistant", "content": "It is sunny."}]


def test_the_result_of_a_skipped_openai_call_goes_with_it():
    conversation = to_conversation("x", {"messages": CALL_TURNS})
    assert [m.role for m in conversation.messages] == ["user", "assistant"]
    assert conversation.skipped_tool_calls == ("arguments_not_json", "result_of_skipped_call")


def test_the_observation_of_a_skipped_sharegpt_call_goes_with_it():
    turns = [{"from": "human", "value": "weather?"}, {"from": "function_call", "value": "{broken"},
             {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "It is sunny."},
             {"from": "function_call", "value": '{"name": "get", "arguments": {}}'},
             {"from": "observation", "value": "rainy"}, {"from": "gpt", "value": "Now rainy."}]
    conversation = to_conversation("x", {"conversations": turns})
    tool = [m for m in conversation.messages if m.role == "tool"]
    assert [(m.content, m.tool_call_id) for m in tool] == [("rainy", "functions.get:0")]
    assert conversation.skipped_tool_calls == ("arguments_not_json", "result_of_skipped_call")
