"""Normalising conversation records to one message schema: `to_conversation` turns one record
(as `common.prepare.readers` reads it from a file) into a `Conversation`, or a `Rejection` saying
why it cannot be used.

A record is a conversation in one of two forms; an optional `id` names it, else the name its
reader gave it (the file and its line or row).

- OpenAI: `{"messages": [...], "tools"?: [...]}`; a message has `role` (system, developer,
  user, assistant, tool), `content` (a string, or a list of parts: text parts are concatenated,
  image/audio/video parts are dropped and counted: the pipeline runs the language model only, so
  it could not compute the vision features a media placeholder stands for), optional `name`,
  `reasoning_content` (or `reasoning`), `tool_calls` (`[{"id", "function": {"name",
  "arguments"}}]`, arguments an object or a string of JSON) and, on tool results, `tool_call_id`.
- ShareGPT: `{"conversations": [{"from", "value"}], "system"?, "tools"?}` with `human`/`gpt`
  turns and the function-calling variants' `function_call` (or `tool_call`) and `observation`
  (or `function_response`, `tool`) turns (`tools` may be a string of JSON, as they write it).

One bad record is a `Rejection` with a reason, so the caller skips and counts it and the run goes
on. A malformed tool call (no id, no function name, arguments neither an object nor JSON text) is
skipped and its reason kept on the conversation (`Conversation.skipped_tool_calls`), and the tool
result that answers it goes with it (counted as `result_of_skipped_call`); the rest is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Message", "ToolCall", "Conversation", "Rejection", "to_conversation"]

# ShareGPT `from` values and OpenAI roles, mapped to the roles chat templates know.
ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "tool": "tool"}
# Roles whose `name` is passed on. An assistant name would change the assistant header, which at
# inference is always the generation prompt's (`assistant`).
NAMED_ROLES = {"system", "user"}
# ShareGPT function-calling variants: the turn names of a call and of its result.
SHAREGPT_CALL_TURNS = {"function_call", "tool_call"}
SHAREGPT_RESULT_TURNS = {"observation", "function_response", "tool"}
# Content parts that are media: dropped from the text, counted.
MEDIA_PARTS = {"image", "image_url", "input_image", "audio", "input_audio", "video", "video_url"}

# Drop reasons of this stage (the report's keys).
MALFORMED_RECORD = "malformed_record"
MALFORMED_TOOLS = "malformed_tools"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT_TURN = "no_assistant_turn"
EMPTY_CONTENT = "empty_content"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # inline reasoning in an answer's text (`_inline_reasoning`)
NON_STRING_CONTENT = "non_string_content"
# Reasons a single tool call is skipped (the report's `tool_calls_skipped` keys).
TOOL_CALL_NO_ID = "no_id"
TOOL_CALL_BAD_ARGUMENTS = "arguments_not_json"
TOOL_CALL_MALFORMED = "no_function_name"
TOOL_RESULT_OF_SKIPPED_CALL = "result_of_skipped_call"  # a tool result dropped with its malformed call


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text: verbatim if the input gave a string, else the object serialised
    arguments_is_object: bool = False  # the input gave an object: the template gets the object

    def to_template(self) -> dict:
        arguments = json.loads(self.arguments) if self.arguments_is_object else self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str
    reasoning: str | None = None  # the assistant's thinking, rendered by the template
    name: str | None = None
    tool_call_id: str | None = None  # tool results: the call they answer
    tool_calls: tuple[ToolCall, ...] = ()

    def to_template(self) -> dict:
        """The message as chat templates take it (OpenAI form)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        return out


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    messages: tuple[Message, ...]
    tools: list | None = None  # tool declarations, passed to the template as `tools`
    media_parts: int = 0  # media content parts dropped
    skipped_tool_calls: tuple[str, ...] = ()  # the reason of each malformed call skipped


@dataclass(frozen=True)
class Rejection:
    """Why one record was skipped: a drop reason of the report and a detail for the warning."""

    reason: str
    detail: str


# --- normalisation: record -> Conversation or Rejection ---------------------------------------

def _parse_arguments(arguments: Any) -> tuple[str, bool] | None:
    """(text, is_object) of a call's arguments: an object (kept as an object: templates render
    it as JSON), or a string holding JSON (kept verbatim); None for anything else."""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False), True
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return arguments, False
    return None


def _tool_call(call: Any, default_id: str | None) -> ToolCall | str:
    """One OpenAI-style call `{"id", "function": {"name", "arguments"}}` (or a bare
    `{"name", "arguments"}`); a skip reason if it is malformed."""
    if not isinstance(call, dict):
        return TOOL_CALL_MALFORMED
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        return TOOL_CALL_MALFORMED
    call_id = call.get("id") or default_id
    if not isinstance(call_id, str) or not call_id:
        return TOOL_CALL_NO_ID
    arguments = _parse_arguments(function.get("arguments", {}))
    if arguments is None:
        return TOOL_CALL_BAD_ARGUMENTS
    return ToolCall(call_id, function["name"], *arguments)


def _content(content: Any) -> tuple[str, int] | None:
    """(text, media parts dropped) of a string or a list of parts; None if neither."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return None
    texts, media = [], 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
            media += 1
        else:
            return None
    return "".join(texts), media


class _Builder:
    """Collects one conversation's messages and what was skipped on the way."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.media = 0
        self.skipped: list[str] = []
        self.pending_ids: list[str | None] = []  # ShareGPT: calls whose observation has not come yet (None: skipped)
        self.skipped_ids: set[str] = set()  # OpenAI: ids of calls skipped as malformed
        self.calls = 0

    def calls_from(self, raw: Any, default_ids: bool) -> tuple[ToolCall, ...]:
        """The well-formed calls of `raw`; ShareGPT's call ids (None for a skipped call) are queued
        for the observations that follow, in order."""
        calls = []
        for call in raw if isinstance(raw, list) else [raw]:
            function = call.get("function", call) if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            default_id = f"functions.{name}:{self.calls}" if default_ids else None  # Kimi's id form
            parsed = _tool_call(call, default_id)
            if isinstance(parsed, str):
                self.skipped.append(parsed)
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    self.skipped_ids.add(call["id"])
            else:
                calls.append(parsed)
                self.calls += 1
            if default_ids:
                self.pending_ids.append(None if isinstance(parsed, str) else parsed.id)
        return tuple(calls)

    def drop_result(self) -> None:
        """A tool result whose call was skipped goes with it (counted with the skipped calls): it
        would answer a call the rendered conversation does not hold."""
        self.skipped.append(TOOL_RESULT_OF_SKIPPED_CALL)

    def add(self, role: Any, content: Any, reasoning: Any = None, *, name: Any = None, tool_call_id: Any = None,
            tool_calls: tuple[ToolCall, ...] = (), had_calls: bool = False) -> Rejection | None:
        """Append one message; `had_calls`: the input turn had tool calls (maybe all malformed)."""
        role = role.lower() if isinstance(role, str) else role
        if not isinstance(role, str) or role not in ROLES:
            return Rejection(UNKNOWN_ROLE, f"role {role!r}")
        role = ROLES[role]
        if content is None and role == "assistant" and (had_calls or reasoning):
            content = ""
        text = _content(content)
        if text is None or not (reasoning is None or isinstance(reasoning, str)):
            bad = content if text is None else reasoning
            return Rejection(NON_STRING_CONTENT, f"{role} content of type {type(bad).__name__}")
        text, media = text
        self.media += media
        if role == "assistant" and reasoning is None:
            text, reasoning = _inline_reasoning(text)
        if not text.strip() and not media and not tool_calls and not reasoning and role != "tool":
            if had_calls or role == "system":
                # its only tool calls were malformed (skipped and counted), or an empty system prompt
                # (as a top-level empty `system`): the message goes, not the conversation
                return None
            return Rejection(EMPTY_CONTENT, f"empty {role} message")
        self.messages.append(Message(
            role, text, reasoning or None,  # an empty thinking block is no thinking
            name=name if isinstance(name, str) and name and role in NAMED_ROLES else None,
            tool_call_id=str(tool_call_id) if tool_call_id is not None else None, tool_calls=tool_calls))
        return None


def _inline_reasoning(text: str) -> tuple[str, str | None]:
    """(content, reasoning) of an answer that writes its reasoning inline, `<think>...</think>`
    before the content (DeepSeek-R1-style data, with no reasoning field): the reasoning goes where
    the target's template renders it, as Qwen3's template and vLLM's reasoning parsers split it.
    Other text is returned as it is, with no reasoning."""
    start = text.lstrip()
    if not (start.startswith(THINK_OPEN) and THINK_CLOSE in start):
        return text, None
    reasoning, content = start[len(THINK_OPEN):].split(THINK_CLOSE, 1)
    return content.lstrip("\n"), reasoning.strip("\n")


def _openai_turn(builder: _Builder, m: dict) -> Rejection | None:
    if m.get("role") == "tool" and m.get("tool_call_id") in builder.skipped_ids:
        builder.drop_result()
        return None
    calls = builder.calls_from(m["tool_calls"], default_ids=False) if m.get("tool_calls") else ()
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    return builder.add(m.get("role"), m.get("content"), reasoning, name=m.get("name"),
                       tool_call_id=m.get("tool_call_id"), tool_calls=calls, had_calls=bool(m.get("tool_calls")))


def _sharegpt_turn(builder: _Builder, m: dict) -> Rejection | None:
    """ShareGPT turns, with the function-calling variant's `function_call` (a JSON call or list
    of calls, merged into the assistant turn just before it if that one has no calls yet) and
    `observation` (the result of the oldest call still waiting) turns. ShareGPT has no call ids:
    they are made up in Kimi's form `functions.NAME:INDEX`."""
    role, value = m.get("from"), m.get("value")
    if role in SHAREGPT_CALL_TURNS:
        try:
            raw = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            raw = None
        calls = builder.calls_from(raw, default_ids=True) if isinstance(raw, (dict, list)) else ()
        if raw is None or not isinstance(raw, (dict, list)):
            builder.skipped.append(TOOL_CALL_BAD_ARGUMENTS)
            builder.pending_ids.append(None)
        last = builder.messages[-1] if builder.messages else None
        if last is not None and last.role == "assistant" and not last.tool_calls:
            builder.messages[-1] = replace(last, tool_calls=calls)
            return None
        return builder.add("assistant", "", tool_calls=calls, had_calls=True)
    if role in SHAREGPT_RESULT_TURNS:
        if builder.pending_ids and builder.pending_ids[0] is None:  # the result of a skipped call
            builder.pending_ids.pop(0)
            builder.drop_result()
            return None
        call_id = builder.pending_ids.pop(0) if builder.pending_ids else None
        return builder.add("tool", value, tool_call_id=call_id)
    return builder.add(role, value)


# Record key -> reader of one turn into the builder.
CONVERSATION_FORMS: dict[str, Callable[[_Builder, dict], Rejection | None]] = {
    "messages": _openai_turn,
    "conversations": _sharegpt_turn,
}


def _sample_id(default: str, record: dict) -> str:
    rid = record.get("id")
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid) else default


def _tools(record: dict) -> list | Rejection | None:
    """The conversation's tool declarations: a list of objects, or a string of JSON holding one
    (ShareGPT function-calling data)."""
    tools = record.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            return Rejection(MALFORMED_TOOLS, f"'tools' is not valid JSON ({e.msg})")
    if tools is None or tools == "" or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return Rejection(MALFORMED_TOOLS, "'tools' must be a list of objects")
    return tools


def to_conversation(default_id: str, record: Any) -> Conversation | Rejection:
    """Normalise one record; a Rejection says why it cannot be used."""
    if isinstance(record, Rejection):
        return record
    if not isinstance(record, dict):
        return Rejection(MALFORMED_RECORD, f"a record must be an object, got {type(record).__name__}")
    form = next((key for key in CONVERSATION_FORMS if isinstance(record.get(key), list)), None)
    if form is None:
        return Rejection(MALFORMED_RECORD, "no 'messages' or 'conversations' list")
    tools = _tools(record)
    if isinstance(tools, Rejection):
        return tools
    builder = _Builder()
    if isinstance(record.get("system"), str) and record["system"].strip():  # ShareGPT's top-level system prompt
        builder.add("system", record["system"])
    for turn in record[form]:
        if not isinstance(turn, dict):
            return Rejection(MALFORMED_RECORD, f"a message must be an object, got {type(turn).__name__}")
        rejection = CONVERSATION_FORMS[form](builder, turn)
        if rejection is not None:
            return rejection
    if not any(m.role == "assistant" for m in builder.messages):
        return Rejection(NO_ASSISTANT_TURN, f"roles {[m.role for m in builder.messages]}")
    return Conversation(_sample_id(default_id, record), tuple(builder.messages), tools,
                        builder.media, tuple(builder.skipped))
