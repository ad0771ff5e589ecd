"""The prompts 05 decodes: 04's held-out prepared rows, or the turns of published prompt sets
rendered with the target's own chat template.

Held-out rows: a prompt is a sample's tokens up to its first supervised token (loss_mask 1): the
conversation up to where the assistant starts answering, as 01 rendered it.

Prompt sets (`common/evaluate/prompt_sets.py`): each user turn is rendered with the target's chat
template and its generation prompt, as a chat-completions request to the served model sends it.
Turn t+1 of an item is asked after the target's own answer to turn t in the same conversation
(FastChat's MT-Bench answer generation): the answer of the target alone (the plain decoding every
draft is compared with, so every draft is measured on the same second turns), decoded to text,
its think block taken off as a chat client sends the content back (`ChatPrompter.answer`), and the
next user turn after it.

Thinking mode (`--thinking on|off`) sets the template variables of Kimi-K2.5's switch
(`thinking`, and Qwen3's `enable_thinking`): the generation prompt ends in `<think>` (thinking) or
`<think></think>` (instant). A template without a switch renders the same prompt either way;
`thinking_switch` tells which, so 05 can refuse a mode the target does not have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.errors import PipelineError
from common.evaluate.prompt_sets import PromptItem
from common.prepare.loss_mask import INSTANT_MODE
from common.regenerate.assistant_output import THINK_OPEN, MalformedToolCall, parse_assistant_text

__all__ = ["HELD_OUT", "Prompt", "select_prompts", "THINKING_ON", "MODE_TEMPERATURE", "thinking_switch",
           "decoding_mode", "ChatPrompter", "ask_turns", "describe_prompts",
           "longest_conversation"]

HELD_OUT = "held-out"  # the prompt-set name of 04's held-out rows
THINKING_ON = {"thinking": True, "enable_thinking": True}  # template variables of thinking mode
# Kimi-K2.5's serving temperatures (its model card): thinking mode 1.0, instant mode 0.6.
MODE_TEMPERATURE = {True: 1.0, False: 0.6}


@dataclass(frozen=True)
class Prompt:
    """One generation's prompt. `row`: the prepared row (held-out), or the generation's index
    over all sets (it seeds the prompt's random stream)."""

    row: int
    sample_id: str
    ids: list[int]
    prompt_set: str = HELD_OUT
    category: str | None = None
    turn: int = 1  # 1-based turn of its conversation


def select_prompts(ds, max_prompts: int, rows: list[int] | None = None) -> tuple[list[Prompt], int]:
    """Up to `max_prompts` prompts from `rows` (default: the dataset's last rows), in row order;
    also the number of candidate rows skipped (no supervised token, or nothing before it)."""
    candidates = list(range(len(ds))) if rows is None else sorted(rows)
    prompts, skipped = [], 0
    for row in reversed(candidates):
        if len(prompts) == max_prompts:
            break
        sample = ds[row]
        mask = sample["loss_mask"]
        first = mask.index(1) if 1 in mask else 0
        if first < 1:
            skipped += 1
            continue
        prompts.append(Prompt(row, str(sample["sample_id"]), list(sample["input_ids"][:first])))
    if not prompts:
        raise PipelineError(f"none of the {len(candidates)} candidate prepared samples has a prompt "
                            "(tokens before its first supervised token)")
    return prompts[::-1], skipped


def _render(tokenizer, messages: list[dict], variables: dict) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)


def thinking_switch(tokenizer) -> bool:
    """Whether the chat template's generation prompt differs between thinking and instant mode."""
    probe = [{"role": "user", "content": "x"}]
    return _render(tokenizer, probe, THINKING_ON) != _render(tokenizer, probe, INSTANT_MODE)


def decoding_mode(tokenizer, thinking: bool | None, temperature: float | None) -> tuple[bool | None, float]:
    """(thinking mode, temperature) of a run on prompt sets. `thinking` None: the template's own
    default; then greedy unless `temperature` is given, as on held-out rows. A mode asked of a
    template without a thinking switch is refused (it would be recorded but change nothing)."""
    if thinking is None:
        return None, 0.0 if temperature is None else temperature
    if not thinking_switch(tokenizer):
        raise PipelineError(f"--thinking {'on' if thinking else 'off'}: the target's chat template has no thinking "
                            "switch (its generation prompt is the same in both modes); leave --thinking out "
                            "(greedy by default, or --temperature T)")
    return thinking, MODE_TEMPERATURE[thinking] if temperature is None else temperature


class ChatPrompter:
    """Renders conversations with the target's chat template in one mode (`thinking` None: the
    template's default) and reads the target's answers back into the conversation."""

    def __init__(self, tokenizer, thinking: bool | None = None):
        self.tokenizer = tokenizer
        self.variables = {} if thinking is None else dict(THINKING_ON if thinking else INSTANT_MODE)
        self.starts_in_thinking = self.render([{"role": "user", "content": "x"}]).endswith(THINK_OPEN)

    def render(self, messages: list[dict]) -> str:
        return _render(self.tokenizer, messages, self.variables)

    def ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.render(messages), add_special_tokens=False)

    def answer(self, tokens: list[int], stop_ids: set[int]) -> dict:
        """The assistant message a chat client sends back after the target wrote `tokens`: the
        content, without the think block and the stop token. An answer cut inside its think block
        (at --max-new-tokens) has no content yet: its reasoning is sent instead, so the next turn
        still follows what the target wrote rather than an empty turn."""
        text = self.tokenizer.decode([t for t in tokens if t not in stop_ids], skip_special_tokens=False)
        try:
            parsed = parse_assistant_text(text, self.starts_in_thinking)
        except MalformedToolCall:  # the content as written: a tool-call section that does not parse
            return {"role": "assistant", "content": text}
        message = parsed.message
        return {"role": "assistant", "content": message.content if parsed.closed_thinking else message.reasoning or ""}


@dataclass
class _Conversation:
    """An item of a prompt set being asked turn by turn."""

    prompt_set: str
    item: PromptItem
    first_row: int  # row of its first turn's prompt
    messages: list[dict]


def ask_turns(sets: dict[str, list[PromptItem]], prompter: ChatPrompter,
              answer: Callable[[list[Prompt]], list[list[int]]], stop_ids: set[int]) -> list[Prompt]:
    """The prompts of every turn of every item of `sets`, in row order (set, item, turn). Turn
    t+1's prompt holds the answer `answer(prompts of turn t)` gave to turn t (one list of
    tokens per prompt, in their order)."""
    conversations, row = [], 0
    for name, items in sets.items():
        for item in items:
            system = [{"role": "system", "content": item.system}] if item.system else []
            conversations.append(_Conversation(name, item, row, system))
            row += len(item.turns)
    prompts: list[Prompt] = []
    for turn in range(max((len(c.item.turns) for c in conversations), default=0)):
        asked = [c for c in conversations if turn < len(c.item.turns)]
        current = [_ask(c, turn, prompter) for c in asked]
        for c, tokens in zip(asked, answer(current), strict=True):
            c.messages.append(prompter.answer(tokens, stop_ids))
        prompts += current
    return sorted(prompts, key=lambda p: p.row)


def _ask(c: _Conversation, turn: int, prompter: ChatPrompter) -> Prompt:
    """The prompt of 0-based `turn` of `c` (its earlier turns and answers already in it)."""
    c.messages.append({"role": "user", "content": c.item.turns[turn]})
    suffix = f":{turn + 1}" if len(c.item.turns) > 1 else ""
    return Prompt(c.first_row + turn, f"{c.prompt_set}:{c.item.item_id}{suffix}", prompter.ids(c.messages),
                  c.prompt_set, c.item.category, turn + 1)


def describe_prompts(sets: dict[str, list[PromptItem]] | None, prompts: list[Prompt], skipped: int,
                     thinking: bool | None) -> str:
    """What is decoded, for the progress line."""
    if sets is None:
        return f"{len(prompts)} prompts (rows {prompts[0].row}..{prompts[-1].row}, {skipped} without a prompt skipped)"
    mode = "template default" if thinking is None else ("on" if thinking else "off")
    return ", ".join(f"{name} ({len(items)} items, {sum(len(i.turns) for i in items)} turns)"
                     for name, items in sets.items()) + f", thinking {mode}"


def longest_conversation(sets: dict[str, list[PromptItem]], prompter: ChatPrompter) -> int:
    """Tokens of the longest item rendered with all its user turns and no answers (what a
    context budget adds the answers to)."""
    longest = 0
    for items in sets.values():
        for item in items:
            system = [{"role": "system", "content": item.system}] if item.system else []
            longest = max(longest, len(prompter.ids(system + [{"role": "user", "content": t} for t in item.turns])))
    return longest
