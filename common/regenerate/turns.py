"""Regenerating conversations turn by turn: `TurnRegenerator` asks an `Engine`
(common/regenerate/engines.py) for each assistant turn, round by round over a batch of
conversations, and reads the answers back (common/regenerate/assistant_output.py); `PartStats`
counts what one part's regeneration did (the run's journal keeps it, common/regenerate/run.py).

Every assistant turn is replaced by what the target generates after the chat template's
generation prompt (thinking mode unless `thinking=False`), given the conversation so far; system,
user, tool declarations and tool results are kept. Later turns see the REGENERATED history: that
is what the target would have seen had it held the conversation, and what the draft meets when it
serves. The prompt is rendered with the template's defaults, as at inference (Kimi: earlier
turns' reasoning dropped); the output keeps every turn's reasoning for 01 to supervise.

Tool results cannot be re-run: an original result is kept only when the regenerated turn calls
the same functions in the same order (the result is re-keyed to the new call id). When the target
calls other functions, or none where the original called some (or the reverse), the conversation
ends with that regenerated turn (`ended_early.tool_calls_diverged`). A turn that cannot be
regenerated (prompt too long, generation cut at the token limit, unparsable tool calls, empty
answer) ends the conversation before it when an earlier turn was regenerated, else drops the
conversation (counted by reason); `keep_too_long` keeps such a conversation as is instead, and
`keep_cut` keeps a cut generation as the conversation's last turn.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.prepare.conversations import Conversation, Message
from common.prepare.loss_mask import INSTANT_MODE
from common.regenerate.assistant_output import THINK_OPEN, MalformedToolCall, parse_assistant_text
from common.regenerate.options import RegenerateOptions

__all__ = ["Completion", "Engine", "PartStats", "TurnRegenerator"]

# Why a turn could not be regenerated (report keys).
PROMPT_TOO_LONG = "prompt_too_long"
GENERATION_CUT = "generation_cut"
MALFORMED_TOOL_CALL = "malformed_tool_call"
EMPTY_ANSWER = "empty_answer"
TOOL_CALLS_DIVERGED = "tool_calls_diverged"


# --- engines ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Completion:
    tokens: list[int]  # generated ids, the stop token excluded
    finished: bool  # ended with a stop token (False: cut at the token limit)


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[Completion]: ...


# --- one conversation, turn by turn -----------------------------------------------------------

@dataclass
class PartStats:
    """Counts of one part (the journal's record); the report sums them."""

    records: int = 0
    regenerated: int = 0
    kept_as_is: int = 0
    dropped: Counter = field(default_factory=Counter)
    ended_early: Counter = field(default_factory=Counter)
    turns: int = 0
    generations: int = 0
    generations_cut: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: PartStats) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def to_json(self) -> dict:
        # not asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs
        return {**vars(self), "dropped": dict(self.dropped), "ended_early": dict(self.ended_early)}

    @classmethod
    def from_json(cls, data: dict) -> PartStats:
        return cls(**{**data, "dropped": Counter(data["dropped"]), "ended_early": Counter(data["ended_early"])})


@dataclass
class _Turns:
    """A conversation being regenerated: the original, the output so far, where the next original
    message is, and the old -> new tool call ids of kept tool results."""

    original: Conversation
    messages: list[Message] = field(default_factory=list)
    position: int = 0
    id_map: dict[str, str] = field(default_factory=dict)
    turns: int = 0
    outcome: str | None = None  # "regenerated", "kept_as_is" or a drop reason; None while running
    early: str | None = None  # why a regenerated conversation ended before its original did

    def next_prompt(self) -> list[Message] | None:
        """Copy the original messages up to the next assistant turn; the history to generate
        from, or None when no assistant turn is left (the conversation is finished)."""
        originals = self.original.messages
        while self.position < len(originals) and originals[self.position].role != "assistant":
            m = originals[self.position]
            if m.role == "tool" and m.tool_call_id in self.id_map:
                m = Message("tool", m.content, tool_call_id=self.id_map[m.tool_call_id])
            self.messages.append(m)
            self.position += 1
        if self.position == len(originals):
            self.end()
            return None
        return self.messages

    def accept(self, message: Message) -> None:
        """The regenerated assistant turn; the conversation ends here when its tool calls differ
        from the original turn's (the original results would answer other calls)."""
        old = self.original.messages[self.position]
        self.messages.append(message)
        self.turns += 1
        self.position += 1
        if [c.name for c in old.tool_calls] != [c.name for c in message.tool_calls]:
            self.end(TOOL_CALLS_DIVERGED)
        else:
            self.id_map.update({a.id: b.id for a, b in zip(old.tool_calls, message.tool_calls)})

    def fail(self, reason: str, keep_as_is: bool = False) -> None:
        if self.turns:
            self.end(reason)
        else:
            self.outcome = "kept_as_is" if keep_as_is else reason

    def end(self, early: str | None = None) -> None:
        """Finished: the output ends with its last regenerated assistant turn."""
        last = max(i for i, m in enumerate(self.messages) if m.role == "assistant") if self.turns else -1
        del self.messages[last + 1:]
        self.outcome = "regenerated" if self.turns else "no_assistant_turn"
        self.early = early

    def record(self) -> dict:
        messages = self.original.messages if self.outcome == "kept_as_is" else self.messages
        out: dict[str, Any] = {"id": self.original.sample_id, "messages": [m.to_template() for m in messages]}
        if self.original.tools:
            out["tools"] = self.original.tools
        return out


class TurnRegenerator:
    """Renders prompts with the target's tokenizer, asks the engine, reads the answers back."""

    def __init__(self, tokenizer, engine: Engine, options: RegenerateOptions):
        self.tokenizer, self.engine, self.options = tokenizer, engine, options
        self.variables = {} if options.thinking else dict(INSTANT_MODE)
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                              add_generation_prompt=True, **self.variables)
        self.starts_in_thinking = probe.endswith(THINK_OPEN)

    def prompt_ids(self, state: _Turns, history: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template([m.to_template() for m in history], tools=state.original.tools,
                                                  tokenize=False, add_generation_prompt=True, **self.variables)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def run(self, conversations: list[Conversation], stats: PartStats, seed: int, on_done) -> list[_Turns]:
        """Regenerate the conversations round by round (round r: the r-th assistant turn of every
        conversation still running, in one engine call)."""
        states = [_Turns(c) for c in conversations]
        running = states
        for round_index in itertools.count():
            waiting = []
            for state in running:
                history = state.next_prompt()
                if history is None:
                    on_done(state)
                    continue
                ids = self.prompt_ids(state, history)
                if len(ids) > self.options.max_prompt_len:
                    state.fail(PROMPT_TOO_LONG, keep_as_is=self.options.keep_too_long)
                    on_done(state)
                else:
                    waiting.append((state, ids))
            if not waiting:
                return states
            completions = self.engine.generate([ids for _, ids in waiting], self.options.max_new_tokens,
                                               seed * 1_000_003 + round_index)
            running = []
            for (state, ids), completion in zip(waiting, completions):
                stats.generations += 1
                stats.prompt_tokens += len(ids)
                stats.generated_tokens += len(completion.tokens) + completion.finished
                if self._apply(state, completion, stats):
                    running.append(state)
                else:
                    on_done(state)
        raise AssertionError("unreachable")

    def _apply(self, state: _Turns, completion: Completion, stats: PartStats) -> bool:
        """Read one generation into the conversation; False when the conversation is finished."""
        text = self.tokenizer.decode(completion.tokens, skip_special_tokens=False)
        stats.generations_cut += not completion.finished
        try:
            parsed = parse_assistant_text(text, self.starts_in_thinking)
        except MalformedToolCall:
            if completion.finished:
                state.fail(MALFORMED_TOOL_CALL)
                return False
            parsed = None  # a call cut in the middle
        answered = parsed is not None and parsed.closed_thinking and (
            parsed.message.content.strip() or parsed.message.tool_calls)
        if not completion.finished and not (self.options.keep_cut and answered):
            state.fail(GENERATION_CUT)
            return False
        if not answered:
            state.fail(EMPTY_ANSWER)
            return False
        stats.tool_calls += len(parsed.message.tool_calls)
        state.accept(parsed.message)
        if not completion.finished:
            state.end(GENERATION_CUT)  # kept (keep_cut): nothing can follow a cut turn
        return state.outcome is None
