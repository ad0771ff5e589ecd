"""common/regenerate/turns.py: the tool-call rule (no model): an original tool result follows a
regenerated call of the same function, re-keyed to the new call id, and a conversation ends where
the target calls other tools."""

from __future__ import annotations

from common.prepare.conversations import Conversation, Message, ToolCall, to_conversation
from common.regenerate.turns import TOOL_CALLS_DIVERGED, _Turns


def _tool_conversation() -> Conversation:
    record = {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": {"name": "f",
                                                                                           "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": "It is 42."}]}
    conversation = to_conversation("t", record)
    assert isinstance(conversation, Conversation)
    return conversation


def test_tool_results_follow_a_regenerated_call_of_the_same_function():
    state = _Turns(_tool_conversation())
    assert [m.role for m in state.next_prompt()] == ["user"]
    state.accept(Message("assistant", "", tool_calls=(ToolCall("functions.f:0", "f", '{"x": 1}'),)))
    history = state.next_prompt()
    assert history[-1] == Message("tool", "42", tool_call_id="functions.f:0")  # re-keyed to the new call
    state.accept(Message("assistant", "Forty-two."))
    assert state.next_prompt() is None and state.outcome == "regenerated" and state.early is None


def test_a_conversation_ends_where_the_target_calls_other_tools():
    state = _Turns(_tool_conversation())
    state.next_prompt()
    state.accept(Message("assistant", "I know it: 42."))  # answers without the call
    assert state.outcome == "regenerated" and state.early == TOOL_CALLS_DIVERGED
    assert [m.role for m in state.messages] == ["user", "assistant"]
