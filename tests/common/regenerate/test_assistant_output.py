"""common/regenerate/assistant_output.py: a generation is read back into reasoning, content and tool
calls, and a tool call that is not JSON is refused."""

from __future__ import annotations

import pytest

from common.prepare.conversations import Message, ToolCall
from common.regenerate.assistant_output import MalformedToolCall, parse_assistant_text


def test_generation_is_split_into_reasoning_content_and_tool_calls():
    text = ("Look it up.</think>Searching.<|tool_calls_section_begin|><|tool_call_begin|>functions.search_web:0"
            '<|tool_call_argument_begin|>{"query": "tides"}<|tool_call_end|><|tool_calls_section_end|>')
    parsed = parse_assistant_text(text, starts_in_thinking=True)
    assert parsed.closed_thinking
    call = ToolCall("functions.search_web:0", "search_web", '{"query": "tides"}')
    assert parsed.message == Message("assistant", "Searching.", "Look it up.", tool_calls=(call,))
    assert parse_assistant_text("<think>\nr\n</think>\n\nHi", False).message == Message("assistant", "Hi", "r")
    cut = parse_assistant_text("still thinking", True)
    assert not cut.closed_thinking and cut.message.content == ""
    with pytest.raises(MalformedToolCall, match="not JSON"):
        parse_assistant_text("</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                             "<|tool_call_argument_begin|>{oops<|tool_call_end|><|tool_calls_section_end|>", True)
