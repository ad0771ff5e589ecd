"""Reading what a target generated for one assistant turn back into a message.

The generated text (special tokens kept, the stop token removed) is split as the chat template
renders an assistant turn: `<think>REASONING</think>CONTENT`, then Kimi-K2.5's tool-call section

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>
    {JSON arguments}<|tool_call_end|>...<|tool_calls_section_end|>

which becomes OpenAI `tool_calls` (id kept verbatim, the name read off the id, arguments kept as
the JSON text the target wrote, so the template renders the same characters again). A thinking
generation prompt ends in `<think>` (Kimi's thinking mode): the generation starts inside the
think block. Templates that wrap reasoning in newlines (`<think>\\n...\\n</think>\\n\\n`) have
those newlines taken off, as their renderer puts them back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from common.prepare.conversations import Message, ToolCall

__all__ = ["THINK_OPEN", "THINK_CLOSE", "ParsedTurn", "MalformedToolCall", "parse_assistant_text"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_RE = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)
# Kimi's call id: `functions.NAME:INDEX`; the name is what lies between.
CALL_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>[^:]+?)(?::\d+)?$")


class MalformedToolCall(ValueError):
    """The target emitted a tool-call section that does not parse (no name, arguments not JSON)."""


@dataclass(frozen=True)
class ParsedTurn:
    message: Message
    closed_thinking: bool  # False: the generation stopped inside its think block


def parse_assistant_text(text: str, starts_in_thinking: bool) -> ParsedTurn:
    """The assistant message of one generation; MalformedToolCall if its tool calls do not parse.
    `starts_in_thinking`: the generation prompt ended with `<think>`."""
    if starts_in_thinking:
        text = THINK_OPEN + text
    reasoning, rest, closed = _split_thinking(text)
    content, calls = _split_tool_calls(rest)
    return ParsedTurn(Message("assistant", content, reasoning, tool_calls=calls), closed)


def _split_thinking(text: str) -> tuple[str | None, str, bool]:
    """(reasoning or None, what follows the think block, whether the block was closed)."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return None, text, True
    inside = stripped[len(THINK_OPEN):]
    end = inside.find(THINK_CLOSE)
    if end < 0:
        return inside.strip("\n") or None, "", False
    reasoning = inside[:end].strip("\n")
    return reasoning or None, inside[end + len(THINK_CLOSE):].lstrip("\n"), True


def _split_tool_calls(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    begin = text.find(SECTION_BEGIN)
    if begin < 0:
        return text, ()
    section = text[begin + len(SECTION_BEGIN):]
    end = section.find(SECTION_END)
    section = section[:end] if end >= 0 else section
    calls = []
    for call_id, arguments in CALL_RE.findall(section):
        call_id = call_id.strip()
        name = CALL_ID_RE.match(call_id)
        if not call_id or name is None:
            raise MalformedToolCall(f"tool call id {call_id!r} names no function")
        try:
            json.loads(arguments)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(f"arguments of {call_id} are not JSON ({e.msg})") from e
        calls.append(ToolCall(call_id, name.group("name"), arguments))
    if not calls:
        raise MalformedToolCall("a tool-call section without a complete call")
    return text[:begin], tuple(calls)
