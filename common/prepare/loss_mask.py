"""Render a conversation with the target tokenizer's own chat template and build its loss mask.

The mask is 1 on exactly what the target generates for each assistant turn after the generation
prompt: for Kimi (prompt `<|im_assistant|>assistant<|im_middle|><think>`) the reasoning,
`</think>`, the content, the tool-call section and `<|im_end|>`; for a turn without reasoning,
instant-mode data, the prompt is `...<|im_middle|><think></think>` and the mask starts after it.
For ChatML it is everything after `<|im_start|>assistant\\n` through `<|im_end|>`.

Reasoning of earlier turns. Kimi's template renders every turn up to the last assistant turn
without tool calls with an empty think block (at inference Kimi drops old reasoning from its
context) unless `preserve_thinking=True`. Rendered that way, no final answer of a training
conversation would show its reasoning. So a template switch that keeps reasoning
(`REASONING_SWITCHES`) is passed when the template has one: every turn is supervised with its
own reasoning, in one sample per conversation; later turns then see earlier reasoning in their
context, which Kimi would not (a context difference accepted for linear cost). A turn whose
reasoning the template still drops (a template without such a switch) is not supervised and is
counted (`Rendering.stripped_turns`): an emptied think block is never trained on silently.

Empty strings. A template may test a string for emptiness (Qwen3 writes a newline before a tool
call only after non-empty content, and its think block only for non-empty reasoning), and a
sentinel is never empty. Such a template is detected by the first conversation whose sentinel
rendering then cannot be aligned; from there empty strings are left as they are. A turn with no
string of its own left to locate (empty content, no reasoning, tool calls whose arguments the
template renders from objects and whose ids it leaves out) cannot be placed: it is not supervised
and is counted (`Rendering.unlocated_turns`).

No offset mapping is needed (Kimi's tokenizer is a slow tiktoken one without them), and nothing
is specific to one model; everything is read off the template's own output:

1. Spans in the text. The conversation is rendered twice: as is, and with every content and
   reasoning string, tool-call id, string arguments and result id replaced by a unique sentinel.
   The sentinel rendering splits into the template's literal text and the places of each string;
   walking both renderings side by side locates every string in the real text (templates may
   trim it). Rendering prefixes `messages[:i]` would not work: Kimi renders an assistant turn
   differently (with or without its reasoning) depending on whether a user message follows it.
   The sentinel rendering holds no content, so it is kept per shape (roles, names, tool names,
   tools): a dataset's conversations of one shape are then rendered about once each.
2. The supervised span of an assistant turn starts after the last assistant header in the
   literal text before its first string, extended over the longest generation prompt (thinking
   or instant mode, read off the template) the text there starts with, and ends after the first
   end-of-turn token in the literal text after its last string (tool calls are literal text in
   between). The assistant header is the generation prompt cut after the role separator (the
   text the template puts between a role name and its content, read off a user turn); the
   end-of-turn token is the first special token the template puts after an assistant message.
3. Tokens. The text is tokenized once, through the tokenizer's fastest call that gives the ids of
   `tokenizer.encode(text, add_special_tokens=False)` (`common.prepare.fast_encode`; for Kimi its own
   tiktoken `encode(text)`). Tokenizers split added tokens off before anything else, so the
   special ids in the result match, in order, the special tokens found in the text, and the runs
   of ids between them match the text between them (checked on every sample). A span boundary
   inside such a run (ChatML's `assistant\\n` header is plain text) is placed by tokenizing the
   run's text up to the boundary and comparing it with the run. That text starts at the special
   token before the boundary, so it is a turn's header (and at most the turn before it), never a
   prefix that grows with the conversation; the same header recurs in every turn, so its ids are
   kept. A Kimi span starts after `<think>` or `</think>` and ends after `<|im_end|>`: no boundary
   falls inside a run, and nothing is tokenized twice.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jinja2 import TemplateError

from common.errors import PipelineError
from common.prepare.chat_template import ChatTemplate
from common.prepare.conversations import Message
from common.prepare.fast_encode import FastEncoder, literal_pattern

__all__ = ["ChatMasker", "Encoded", "MaskError", "Rendering", "template_sha256"]

# Drop reasons of this stage (the report's keys).
TEMPLATE_ERROR = "template_error"
TEMPLATE_MISMATCH = "template_mismatch"
TOKENIZER_MISMATCH = "tokenizer_mismatch"
NO_SUPERVISED_TOKENS = "no_supervised_tokens"

# Template variables that keep every turn's reasoning, and their value (Kimi: preserve_thinking).
REASONING_SWITCHES = {"preserve_thinking": True}
# Template variables that ask for the instant-mode (no thinking) generation prompt.
INSTANT_MODE = {"thinking": False, "enable_thinking": False}

# Sentinel renderings kept, by conversation shape (`ChatMasker._place`).
SKELETON_CACHE_SIZE = 1024
# Run prefixes whose ids are kept (ChatML's `assistant\n`, one per template in practice).
PREFIX_CACHE_SIZE = 256

# Private-use code points: no template alters them and no real text contains them.
SENTINEL = "\ue000{}\ue001"
SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")

# No system message: some templates (Gemma's) reject one. The last turn has no reasoning, so a
# template that drops earlier reasoning still leaves a turn to check.
PROBE = (
    Message("user", "What is 2 + 2?"),
    Message("assistant", "It is 4.", "Add the numbers."),
    Message("user", "And 3 + 3?\n"),
    Message("assistant", " 6, of course.\n"),
)


class MaskError(Exception):
    """One conversation that cannot be rendered or masked; `reason` is a report key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Rendering:
    """A rendered conversation, its supervised character spans and what they hold."""

    text: str
    spans: list[tuple[int, int]]  # [start, end) per supervised assistant turn
    reasoning_turns: int = 0  # supervised turns whose reasoning is in the text
    stripped_turns: int = 0  # turns with reasoning the template dropped: not supervised
    tool_calls: int = 0  # tool calls of supervised turns
    tool_calls_not_rendered: int = 0  # ... that the template does not render
    unlocated_turns: int = 0  # turns with no string of theirs in the text (see `render`): not supervised


@dataclass(frozen=True, eq=False)
class Encoded:
    ids: np.ndarray  # int32 token ids
    mask: np.ndarray  # int8, 1 on supervised tokens
    rendering: Rendering | None = None

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Encoded) and np.array_equal(self.ids, other.ids)
                and np.array_equal(self.mask, other.mask) and self.rendering == other.rendering)

    @property
    def input_ids(self) -> list[int]:
        return self.ids.tolist()

    @property
    def loss_mask(self) -> list[int]:
        return self.mask.tolist()


def template_sha256(tokenizer) -> str:
    return hashlib.sha256(tokenizer.get_chat_template().encode("utf-8")).hexdigest()


class ChatMasker:
    """Encodes conversations for one tokenizer; built once, then `encode` per conversation."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        try:
            source = tokenizer.get_chat_template()
        except ValueError as e:
            raise PipelineError(f"tokenizer {tokenizer.name_or_path}: no chat template ({e})") from e
        self.switches = {k: v for k, v in REASONING_SWITCHES.items() if k in source}
        # Added tokens the tokenizer splits off verbatim (no stripping or normalisation).
        self.cut_ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()
                        if not (t.lstrip or t.rstrip or t.single_word) and (t.special or not t.normalized)}
        # A lookup table of the cut ids: finding them in a long conversation's ids is one numpy
        # pass, not a Python loop over every token (which cost a third of the encode).
        self._is_cut = np.zeros(max(self.cut_ids.values(), default=-1) + 1, dtype=bool)
        self._is_cut[list(self.cut_ids.values())] = True
        self._cut_re = re.compile("(" + (literal_pattern(self.cut_ids) or "(?!)") + ")")
        self.template = ChatTemplate(tokenizer)
        self._prefix_ids: dict[str, list[int]] = {}
        self._skeletons: dict[str, str] = {}
        # What `render` marks with sentinels, until a conversation shows the template does not allow it:
        self._marks_calls = True  # tool-call ids and string arguments
        self._marks_empty = True  # empty strings
        try:
            self.header = self._assistant_header()
            self.prompts = self._generation_prompts()
            self.end_of_turn = self._end_of_turn()
            self.renders_tool_calls = self._renders_tool_calls()
            self.encoder = FastEncoder(tokenizer, probes=(self._render([m.to_template() for m in PROBE]),))
            self._check_probe()
        except MaskError as e:
            raise PipelineError(f"tokenizer {tokenizer.name_or_path}: cannot build loss masks ({e})") from e

    # --- public -----------------------------------------------------------------------------

    def describe(self) -> dict:
        """How conversations are rendered and masked (the report's `rendering`)."""
        return {
            "template_switches": dict(self.switches),
            "earlier_turns_reasoning": ("kept: every turn is supervised with its reasoning ("
                                        + ", ".join(f"{k}={v}" for k, v in self.switches.items()) + ")"
                                        if self.switches else "as the template renders it; a turn whose "
                                        "reasoning it drops is not supervised (stripped_turns)"),
            "generation_prompts": list(self.prompts),
            "end_of_turn": self.end_of_turn,
            "renders_tool_calls": self.renders_tool_calls,
            "token_ids": self.encoder.describe(),
            "media_parts": "dropped from the text and counted (the language model alone cannot compute "
                           "what a media placeholder stands for)",
        }

    def encode(self, messages: Sequence[Message], tools: list | None = None) -> Encoded:
        """Token ids of the rendered conversation and their loss mask; MaskError if unusable."""
        rendering = self.render(messages, tools)
        listed = self.encoder(rendering.text)
        ids = np.fromiter(listed, np.int32, len(listed))
        return Encoded(ids, self._mask(rendering.text, ids, rendering.spans), rendering)

    def render_with_spans(self, messages: Sequence[Message], tools: list | None = None
                          ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) that are supervised."""
        rendering = self.render(messages, tools)
        return rendering.text, rendering.spans

    def render(self, messages: Sequence[Message], tools: list | None = None) -> Rendering:
        """The rendering, its supervised spans and counts. Strings are marked as this masker has
        found the template to allow (`_marks_empty`, `_marks_calls`); where the sentinel rendering
        cannot be aligned, less is marked, empty strings first (for a conversation that holds one),
        then tool calls, and what works is kept for the conversations after."""
        choices = [(self._marks_empty, self._marks_calls)]
        if self._marks_empty and any(_empty_strings(m.to_template()) for m in messages):
            choices.append((False, self._marks_calls))
        if self._marks_calls:
            choices += [(empty, False) for empty, _ in choices]
        for i, (marks_empty, marks_calls) in enumerate(choices):
            try:
                rendering = self._render_marked(messages, tools, marks_empty, marks_calls)
            except MaskError:
                if i == len(choices) - 1:
                    raise
                continue
            self._marks_empty, self._marks_calls = marks_empty, marks_calls
            return rendering
        raise AssertionError("unreachable: the last choice returns or raises")

    def _render_marked(self, messages: Sequence[Message], tools: list | None, marks_empty: bool,
                       marks_calls: bool) -> Rendering:
        values: list[str] = []
        owners: list[tuple[int, str]] = []  # value index -> (message index, field)
        real, calls_real, marked = [], [], []

        def sentinel(value: str, j: int, name: str) -> str:
            if not (value or marks_empty):
                return value
            values.append(value)
            owners.append((j, name))
            return SENTINEL.format(len(values) - 1)

        for j, m in enumerate(messages):
            message = m.to_template()
            real.append(message)
            calls_real.append({**message, **{k: sentinel(message[k], j, k)
                                             for k in ("content", "reasoning_content") if k in message}})
            calls = {}
            if message.get("tool_call_id") is not None:
                calls["tool_call_id"] = sentinel(message["tool_call_id"], j, "tool_call_id")
            if "tool_calls" in message:
                calls["tool_calls"] = [_marked_call(call, lambda v: sentinel(v, j, "tool_call"))
                                       for call in message["tool_calls"]]
            marked.append({**calls_real[-1], **calls})
        text = self._render(real, tools=tools)
        placed = self._place(marked, calls_real, tools, text, values, marks_calls)
        by_message: dict[int, list[int]] = {}
        reasoning_placed = set()
        for i, (key, _, _) in enumerate(placed):
            j, name = owners[key]
            by_message.setdefault(j, []).append(i)
            if name == "reasoning_content":
                reasoning_placed.add(j)
        spans, reasoning, stripped, unlocated, calls = [], 0, 0, 0, 0
        for j, m in enumerate(messages):
            if m.role != "assistant":
                continue
            if m.reasoning is not None and j not in reasoning_placed:
                stripped += 1  # an emptied think block: not what the model generated for this turn
            elif j not in by_message:
                unlocated += 1  # no string of its own in the text to place its span by
            else:
                spans.append(self._span(text, placed, by_message[j]))
                reasoning += m.reasoning is not None
                calls += len(m.tool_calls)
        return Rendering(text, spans, reasoning, stripped, calls, 0 if self.renders_tool_calls else calls, unlocated)

    def _place(self, marked: list[dict], calls_real: list[dict], tools: list | None, text: str,
               values: list[str], marks_calls: bool) -> list[tuple[int, int, int]]:
        """`_align` of the sentinel rendering. That rendering depends on the conversation's shape
        only (roles, names, tool names, object arguments, tools: no content, and no tool-call id,
        string arguments or result id, which are sentinels too), and a dataset's conversations
        share few shapes, so theirs is kept per shape (rendering is most of 01's time). A kept one
        that no longer fits (a template that reads the clock) is rendered again. Without
        `marks_calls` (a template that renders a tool call's sentinels so that they cannot be
        aligned: one that parses its arguments) the real calls, `calls_real`, are rendered: that
        rendering is the conversation's own and is not kept."""
        if not marks_calls and marked != calls_real:
            return _align(self._render(calls_real, tools=tools), text, values)
        key = repr((marked, tools))
        kept = self._skeletons.get(key)
        if kept is not None:
            try:
                return _align(kept, text, values)
            except MaskError:
                pass
        skeleton = self._render(marked, tools=tools)
        placed = _align(skeleton, text, values)
        if len(self._skeletons) >= SKELETON_CACHE_SIZE:
            self._skeletons.clear()
        self._skeletons[key] = skeleton
        return placed

    # --- template analysis ------------------------------------------------------------------

    def _render(self, messages: list[dict], generation_prompt: bool = False, tools: list | None = None,
                **variables) -> str:
        try:
            return self.template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                 **{**self.switches, **variables})
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise MaskError(TEMPLATE_ERROR, str(e).splitlines()[0] if str(e) else type(e).__name__) from e

    def _prompt(self, **variables) -> tuple[str, str]:
        """(rendering of one user message, the generation prompt appended to it)."""
        user = [{"role": "user", "content": SENTINEL.format(0)}]
        without, with_prompt = self._render(user), self._render(user, generation_prompt=True, **variables)
        if not with_prompt.startswith(without):
            raise MaskError(TEMPLATE_MISMATCH, "the generation prompt is not appended to the conversation")
        return without, with_prompt[len(without):]

    def _assistant_header(self) -> str:
        """The text that opens an assistant turn: the generation prompt, cut after the role
        separator read off a user turn (`<|im_middle|>` for Kimi, `\\n` for ChatML)."""
        without, prompt = self._prompt()
        user_header = without[:without.index(SENTINEL.format(0))]
        name = user_header.rfind("user")
        separator = user_header[name + len("user"):] if name >= 0 else ""
        cut = prompt.find(separator) if separator else -1
        return prompt[:cut + len(separator)] if cut >= 0 else prompt

    def _generation_prompts(self) -> tuple[str, ...]:
        """The generation prompts (thinking and instant mode), longest first: what a turn's
        text starts with up to there is prompt, not generated."""
        prompts = {self._prompt()[1], self._prompt(**INSTANT_MODE)[1]}
        return tuple(sorted((p for p in prompts if p.startswith(self.header)), key=len, reverse=True))

    def _end_of_turn(self) -> str:
        """The first special token the template puts after an assistant message's content."""
        skeleton = self._render([{"role": "user", "content": SENTINEL.format(0)},
                                 {"role": "assistant", "content": SENTINEL.format(1)}])
        after = skeleton[skeleton.index(SENTINEL.format(1)) + len(SENTINEL.format(1)):]
        found = self._cut_re.search(after)
        if found is None:
            raise MaskError(TEMPLATE_MISMATCH, "no special token ends an assistant turn")
        return found.group()

    def _renders_tool_calls(self) -> bool:
        """Whether the template writes tool calls into the text (plain ChatML does not)."""
        arguments = SENTINEL.format(0)
        call = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": arguments}}
        try:
            text = self._render([{"role": "user", "content": "?"},
                                 {"role": "assistant", "content": "", "tool_calls": [call]}])
        except MaskError:
            return False
        return arguments in text

    def _check_probe(self) -> None:
        """Every supervised probe assistant turn must become one run of supervised tokens."""
        encoded = self.encode(PROBE)
        mask = encoded.loss_mask
        runs = sum(1 for prev, cur in zip([0, *mask], mask) if cur and not prev)
        turns = len(encoded.rendering.spans)
        if runs != turns or turns == 0:
            raise MaskError(TEMPLATE_MISMATCH, f"{turns} supervised assistant turns gave {runs} runs of supervised tokens")

    def _span(self, text: str, placed: list[tuple[int, int, int]], mine: list[int]) -> tuple[int, int]:
        first, last = placed[mine[0]], placed[mine[-1]]
        literal_start = placed[mine[0] - 1][2] if mine[0] else 0
        header = text.rfind(self.header, literal_start, first[1])
        if header < 0:
            raise MaskError(TEMPLATE_MISMATCH, f"assistant header {self.header!r} not found before a turn")
        start = header + len(self.header)
        prompt = next((p for p in self.prompts if text.startswith(p, header) and header + len(p) <= first[1]), None)
        if prompt is not None:
            start = header + len(prompt)
        literal_end = placed[mine[-1] + 1][1] if mine[-1] + 1 < len(placed) else len(text)
        end_of_turn = text.find(self.end_of_turn, last[2], literal_end)
        return start, end_of_turn + len(self.end_of_turn) if end_of_turn >= 0 else last[2]

    # --- tokens -----------------------------------------------------------------------------

    def _mask(self, text: str, ids: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
        """The int8 mask of `text`'s `ids`."""
        parts = self._cut_re.split(text)  # run, special token, run, ..., run
        known = ids < len(self._is_cut)  # an id past the table is no cut id
        is_cut = np.zeros(len(ids), dtype=bool)
        is_cut[known] = self._is_cut[ids[known]]
        positions = np.flatnonzero(is_cut)
        if ids[positions].tolist() != [self.cut_ids[cut] for cut in parts[1::2]]:
            raise MaskError(TOKENIZER_MISMATCH, "the special tokens in the ids do not match those in the text")
        # The runs of ids between the special tokens: text[chars[k]:ends[k]] is ids[firsts[k]:stops[k]].
        offsets = np.cumsum([0, *map(len, parts)])
        chars, ends = offsets[0:-1:2], offsets[1::2]
        firsts, stops = np.concatenate([[0], positions + 1]), np.concatenate([positions, [len(ids)]])
        if np.any((chars == ends) & (stops > firsts)):
            raise MaskError(TOKENIZER_MISMATCH, "ids between adjacent special tokens")
        # A special token takes the mask of its first character, a run without a span boundary
        # inside that of its first; the few runs with one are placed token by token (_mark_run).
        inside = _Spans(spans)
        mask = np.zeros(len(ids), dtype=np.int8)
        mask[positions] = inside.at(ends[:-1])
        mask[~is_cut] = np.repeat(inside.at(chars), stops - firsts)
        for k in np.flatnonzero(inside.edges_between(chars, ends)):
            first, stop = int(firsts[k]), int(stops[k])
            mask[first:stop] = 0
            self._mark_run(text, int(chars[k]), int(ends[k]), ids, first, stop, inside, mask)
        return mask

    def _mark_run(self, text: str, start: int, end: int, ids: np.ndarray, first: int, stop: int,
                  inside: _Spans, mask: np.ndarray) -> None:
        """Mark the ids[first:stop] that encode text[start:end] (no special token inside, a span
        boundary inside)."""
        chars, tokens = [start], [first]
        for boundary in inside.boundaries(start, end):
            left = self._prefix(text[start:boundary])
            k = _common_prefix(left, ids[first:min(stop, first + len(left))].tolist())
            if k < len(left) and not inside(boundary):
                k += 1  # a token across the end of a span is supervised, like one across its start
            chars.append(boundary)
            tokens.append(min(max(first + k, tokens[-1]), stop))
        tokens.append(stop)
        for char, lo, hi in zip(chars, tokens, tokens[1:]):
            if inside(char):
                mask[lo:hi] = 1

    def _prefix(self, text: str) -> list[int]:
        """The ids of a run's text up to a span boundary; kept, as the same header recurs every turn."""
        ids = self._prefix_ids.get(text)
        if ids is None:
            if len(self._prefix_ids) >= PREFIX_CACHE_SIZE:
                self._prefix_ids.clear()
            ids = self._prefix_ids[text] = self.encoder(text)
        return ids


class _Spans:
    """Membership of characters in the supervised spans, by bisection (a conversation has many)."""

    def __init__(self, spans: list[tuple[int, int]]):
        merged: list[list[int]] = []
        for lo, hi in sorted(s for s in spans if s[0] < s[1]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts, self.ends = [lo for lo, _ in merged], [hi for _, hi in merged]
        self.edges = sorted({b for span in spans for b in span})

    def __call__(self, char: int) -> bool:
        i = bisect.bisect_right(self.starts, char) - 1
        return i >= 0 and char < self.ends[i]

    def at(self, chars: np.ndarray) -> np.ndarray:
        """`self(c)` for each of `chars`, as 0/1."""
        if not self.starts:
            return np.zeros(len(chars), dtype=np.int8)
        i = np.searchsorted(self.starts, chars, side="right") - 1
        return ((i >= 0) & (chars < np.asarray(self.ends)[np.maximum(i, 0)])).astype(np.int8)

    def boundaries(self, start: int, end: int) -> list[int]:
        """The span edges strictly between `start` and `end`, in order."""
        return self.edges[bisect.bisect_right(self.edges, start):bisect.bisect_left(self.edges, end)]

    def edges_between(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Whether a span edge lies strictly inside each interval (starts[k], ends[k])."""
        return np.searchsorted(self.edges, ends, side="left") > np.searchsorted(self.edges, starts, side="right")


def _empty_strings(message: dict) -> bool:
    """Whether a template message holds an empty string that `render` would mark."""
    calls = message.get("tool_calls") or []
    return any(message.get(k) == "" for k in ("content", "reasoning_content", "tool_call_id")) or any(
        c.get("id") == "" or c["function"]["arguments"] == "" for c in calls)


def _marked_call(call: dict, sentinel) -> dict:
    """A template's tool call with its id and string arguments replaced by `sentinel(value)`
    (object arguments are kept: a template renders them through `tojson`, not as they are)."""
    function = call["function"]
    arguments = function["arguments"]
    return {**call, "id": sentinel(call["id"]) if isinstance(call.get("id"), str) else call.get("id"),
            "function": {**function, "arguments": sentinel(arguments) if isinstance(arguments, str) else arguments}}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _align(skeleton: str, text: str, values: list[str]) -> list[tuple[int, int, int]]:
    """(value index, start, end) of each sentinel of `skeleton` in the real rendering `text`."""
    parts = SENTINEL_RE.split(skeleton)
    literals, keys = parts[0::2], [int(k) for k in parts[1::2]]
    if not text.startswith(literals[0]):
        raise MaskError(TEMPLATE_MISMATCH, "the template renders differently around the messages")
    pos, placed = len(literals[0]), []
    for key, literal in zip(keys, literals[1:]):
        end = _value_end(text, pos, values[key], literal)
        placed.append((key, pos, end))
        pos = end + len(literal)
    if pos != len(text):
        raise MaskError(TEMPLATE_MISMATCH, "the template renders differently around the messages")
    return placed


def _value_end(text: str, pos: int, value: str, literal: str) -> int:
    """Where the rendering of `value` that starts at `pos` ends (templates may trim it)."""
    for candidate in (value, value.strip()):
        end = pos + len(candidate)
        if text.startswith(candidate, pos) and text.startswith(literal, end):
            return end
    end = text.find(literal, pos) if literal else -1
    if end < 0:
        raise MaskError(TEMPLATE_MISMATCH, "a message's text cannot be located in the rendering")
    return end
