"""Reading records: undecodable text is a counted rejection; a skipped tool call takes its result along."""

from __future__ import annotations

from common.data.conversations import UNDECODABLE, Rejection, read_jsonl, to_conversation

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


def test_undecodable_lines_are_rejections_naming_the_line_and_a_bom_is_read_past(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"messages": []}\n{"a": "\xff"}\n{"a": "\\udc00 x"}\n{"a": "\\ud83d\\ude00"}\n')
    records = list(read_jsonl(path))
    assert records[0] == (f"{path}:1", {"messages": []})
    assert records[1] == (f"{path}:2", Rejection(UNDECODABLE, "not UTF-8 text (byte 0xff at column 8)"))
    assert records[2] == (f"{path}:3", Rejection(UNDECODABLE, "a string holds a lone surrogate \\udc00 (a \\u escape "
                                                              "without its pair)"))
    assert records[3] == (f"{path}:4", {"a": "\N{GRINNING FACE}"})
