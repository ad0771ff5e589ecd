"""common/prepare/loss_mask.py: masks hand-derived for both miniature targets, template variants and
errors, and the ids of long tool-calling conversations (through the fast encode path) against
`tokenizer.encode(text, add_special_tokens=False)`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.errors import PipelineError
from common.miniatures.targets import FLAT_CHAT_TEMPLATE
from common.prepare.conversations import Message, ToolCall, to_conversation
from common.prepare.fast_encode import BACKEND, OWN_ENCODE
from common.prepare.loss_mask import TEMPLATE_ERROR, ChatMasker, MaskError

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
        runs = supervised_runs(tok, encoded)
        assert runs == [text[a:b] for a, b in spans]
        assert len(spans) == sum(m.role == "assistant" for m in conversation.messages)
        assert encoded.rendering.stripped_turns == 0
        # Every turn's reasoning is supervised on both targets.
        assert encoded.rendering.reasoning_turns == sum(m.reasoning is not None for m in conversation.messages)


def supervised_runs(tok, encoded) -> list[str]:
    """The decoded text of each run of supervised tokens, in order."""
    runs, run = [], []
    for token, m in zip(encoded.input_ids + [None], encoded.loss_mask + [0]):
        if m:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


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


# Qwen3's own chat template, as Qwen/Qwen3-8B's tokenizer_config.json ships it: it tests strings for
# emptiness (a newline before a tool call only after non-empty content) and renders the reasoning of
# the turns after the last user query only.
QWEN3_TEMPLATE = Path(__file__).parents[2] / "data" / "qwen3_chat_template.jinja"
OBJECT_CALL = ToolCall("call_1", "get_weather", '{"city": "Rome"}', arguments_is_object=True)


def test_a_template_that_tests_strings_for_emptiness(flat_target):
    """Qwen3's template: a tool-call turn with empty content is supervised from its think block
    through `<|im_end|>`, with no newline before the call (a sentinel for the empty content would
    have rendered one); the masker leaves empty strings as they are from then on."""
    tok = _variant(flat_target, QWEN3_TEMPLATE.read_text())
    masker = ChatMasker(tok)
    encoded = masker.encode(TOOL_TURNS, TOOLS)
    prompt = tok.apply_chat_template([TOOL_TURNS[0].to_template()], tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    ids, mask = expected(tok, [
        (prompt, 0),
        ('<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         "\n</tool_call><|im_end|>", 1),
        ('\n<|im_start|>user\n<tool_response>\n{"temp": 14}\n</tool_response><|im_end|>\n<|im_start|>assistant\n', 0),
        ("<think>\nReport it.\n</think>\n\n14 °C in Paris.<|im_end|>", 1), ("\n", 0)])
    assert (encoded.input_ids, encoded.loss_mask) == (ids, mask)
    assert (encoded.rendering.reasoning_turns, encoded.rendering.tool_calls, encoded.rendering.stripped_turns) == (2, 1, 0)
    assert not masker._marks_empty and masker._marks_calls  # the calls' sentinels were never the trouble


def test_an_empty_string_does_not_cost_a_tool_call_its_sentinels(flat_target):
    """The first conversation a Qwen3 masker sees: a call with no content and no reasoning, whose
    string arguments are all there is to place the turn by. Its failed first alignment (the empty
    content's sentinel) is put down to the empty string, not to the call."""
    tok = _variant(flat_target, QWEN3_TEMPLATE.read_text())
    masker = ChatMasker(tok)
    turns = (TOOL_TURNS[0], Message("assistant", "", tool_calls=(CALL,)), *TOOL_TURNS[2:])
    r = masker.encode(turns, TOOLS).rendering
    assert (len(r.spans), r.tool_calls, r.unlocated_turns) == (2, 1, 0)
    assert r.text[slice(*r.spans[0])] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert (masker._marks_empty, masker._marks_calls) == (False, True)


def test_turns_a_template_leaves_nothing_of_are_counted(flat_target):
    """Under Qwen3's template: the first answer's reasoning is dropped (it comes before the last user
    query), and a turn of empty content, no reasoning and a call with object arguments has no string
    left to place it by. Neither is supervised; each is counted; the last answer is supervised."""
    tok = _variant(flat_target, QWEN3_TEMPLATE.read_text())
    turns = (U, A_THINK, U2, Message("assistant", "", tool_calls=(OBJECT_CALL,)),
             Message("tool", '{"temp": 19}', tool_call_id=OBJECT_CALL.id), Message("assistant", "19 °C in Rome."))
    encoded = ChatMasker(tok).encode(turns, TOOLS)
    r = encoded.rendering
    assert (r.stripped_turns, r.unlocated_turns, len(r.spans), r.tool_calls) == (1, 1, 1, 0)
    assert r.text[slice(*r.spans[0])] == "19 °C in Rome.<|im_end|>"
    assert tok.decode([i for i, m in zip(encoded.input_ids, encoded.loss_mask) if m]) == "19 °C in Rome.<|im_end|>"


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



@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_conversations_of_one_shape_share_the_sentinel_rendering(tokenizers, kind):
    """The sentinel rendering holds no content: a second conversation of the same shape reuses it
    and gets what a fresh masker gives; a kept one that no longer fits (as for a template that
    reads the clock) is rendered again."""
    masker = ChatMasker(tokenizers[kind])
    masker.encode((U, A_THINK, U2, A2))
    kept = dict(masker._skeletons)
    other = (Message("user", "Other words"), Message("assistant", "Another answer.", "Other reasoning"),
             Message("user", "More?\n"), Message("assistant", "Yes, more.", "Think again."))
    fresh = ChatMasker(tokenizers[kind]).encode(other)
    shared = masker.encode(other)
    assert masker._skeletons == kept  # nothing rendered anew
    assert (shared.input_ids, shared.loss_mask, shared.rendering) == (fresh.input_ids, fresh.loss_mask, fresh.rendering)
    masker._skeletons = {key: "stale " + skeleton for key, skeleton in kept.items()}
    again = masker.encode(other)
    assert (again.input_ids, again.loss_mask, again.rendering) == (fresh.input_ids, fresh.loss_mask, fresh.rendering)


def _kimi_variant(kimi_target: Path, old: str, new: str):
    tok = AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True)
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, new)
    return tok


def _conservative(tok) -> ChatMasker:
    """A masker that renders tool-calling conversations' sentinels with the real calls (each
    conversation's own sentinel rendering, kept for none), as 01 did before calls were marked."""
    masker = ChatMasker(tok)
    masker._marks_calls = False
    return masker


def _other_call_turns(seed: int) -> tuple[Message, ...]:
    """TOOL_TURNS' shape with other words, call id, arguments and result."""
    call = ToolCall(f"functions.get_weather:{seed + 7}", "get_weather", json.dumps({"city": f"Town {seed}", "n": seed}))
    return (Message("user", f"Weather in town {seed}?"), Message("assistant", "", f"Look it up ({seed}).", tool_calls=(call,)),
            Message("tool", json.dumps({"temp": seed}), tool_call_id=call.id),
            Message("assistant", f"{seed} °C there.", "Say it."))


def test_tool_calling_conversations_of_one_shape_share_the_sentinel_rendering(kimi_target, tokenizers):
    """Tool-call ids, string arguments and result ids are sentinels too, so conversations that
    differ in them share one sentinel rendering, and encode as the conservative path does."""
    masker, conservative = ChatMasker(tokenizers["kimi"]), _conservative(tokenizers["kimi"])
    kept = None
    for seed in range(3):
        turns = _other_call_turns(seed)
        shared, alone = masker.encode(turns, TOOLS), conservative.encode(turns, TOOLS)
        assert (shared.input_ids, shared.loss_mask, shared.rendering) == (alone.input_ids, alone.loss_mask, alone.rendering)
        assert f"functions.get_weather:{seed + 7}" in shared.rendering.text[slice(*shared.rendering.spans[0])]
        kept = kept or dict(masker._skeletons)
        assert masker._skeletons == kept  # one shape: rendered for the first conversation only
    assert masker._marks_calls
    assert len(conservative._skeletons) == len(kept) - 1  # each conversation's own: not kept


# Kimi template variants that render tool calls otherwise: arguments always through tojson (as
# Llama 3.1's does), a transformed id, an id written twice, and a branch on the arguments' text
# (a sentinel takes the other branch, so the sentinel rendering cannot be aligned: the masker goes
# back to the real calls for the rest of the run).
CALL_VARIANTS = {
    "tojson arguments": ("{%- if arguments is string -%}{{ arguments }}{%- else -%}{{ arguments | tojson }}{%- endif -%}",
                         "{{ arguments | tojson }}"),
    "upper-case id": ("<|tool_call_begin|>{{ call['id'] }}", "<|tool_call_begin|>{{ call['id'] | upper }}"),
    "id twice": ("<|tool_call_begin|>{{ call['id'] }}", "<|tool_call_begin|>{{ call['id'] }} {{ call['id'] }}"),
    "branch on arguments": ("{%- if arguments is string -%}{{ arguments }}",
                            "{%- if arguments is string and arguments.startswith('{') -%}{{ arguments }}"
                            "{%- elif arguments is string -%}<|im_end|>{{ arguments }}"),
}


@pytest.mark.parametrize("variant", list(CALL_VARIANTS))
def test_templates_that_render_tool_calls_otherwise(kimi_target, variant):
    tok = _kimi_variant(kimi_target, *CALL_VARIANTS[variant])
    masker, conservative = ChatMasker(tok), _conservative(tok)
    for turns in (TOOL_TURNS, *map(_other_call_turns, range(3))):
        shared, alone = masker.encode(turns, TOOLS), conservative.encode(turns, TOOLS)
        assert (shared.input_ids, shared.loss_mask, shared.rendering) == (alone.input_ids, alone.loss_mask, alone.rendering)
        assert sum(shared.loss_mask) > 0 and len(shared.rendering.spans) == 2
    assert masker._marks_calls == (variant != "branch on arguments")


# --- long conversations: the fast encode path gives the reference ids ---------------------------

# What users type that looks like the templates' markers; each must tokenize as the base class's
# path would (for these tokenizers: the added tokens become their ids, the rest plain text).
LOOKALIKES = ("<|im_end|>", "<think>", "</think>", "<|im_start|>assistant\n", "<|im_assistant|>assistant<|im_middle|>",
              "<|tool_call_begin|>", "[EOS]", "<|im_end", "<think >", "  ", "\n\n", "你好，世界 🙂")
WORDS = "the model answer weather city we can see that it is of and to in 42 3.14 def return".split()


def _words(rng, n: int, lookalikes: bool) -> str:
    parts = [rng.choice(LOOKALIKES) if lookalikes and rng.random() < 0.2 else rng.choice(WORDS) for _ in range(n)]
    return " ".join(parts).strip() or "x"


def long_conversation(seed: int, exchanges: int) -> list[Message]:
    """A system prompt, then `exchanges` user turns with lookalikes inside, a third of them answered
    through a tool call (its result also holding lookalikes), most answers with reasoning."""
    rng = random.Random(seed)
    messages = [Message("system", _words(rng, 8, True))]
    for i in range(exchanges):
        messages.append(Message("user", _words(rng, rng.randint(5, 60), True)))
        if i % 3 == 0:
            call = ToolCall(f"functions.get_weather:{i}", "get_weather", json.dumps({"city": _words(rng, 2, False)}))
            messages += [Message("assistant", "", _words(rng, 10, False), tool_calls=(call,)),
                         Message("tool", _words(rng, 15, True), tool_call_id=call.id)]
        reasoning = _words(rng, rng.randint(3, 40), False) if rng.random() < 0.7 else None
        messages.append(Message("assistant", _words(rng, rng.randint(5, 80), False), reasoning))
    return messages


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_long_conversations_get_the_reference_ids_through_the_fast_path(maskers, tokenizers, kind):
    tok, masker = tokenizers[kind], maskers[kind]
    assert masker.encoder.path == {"kimi": OWN_ENCODE, "flat": BACKEND}[kind]  # not the slow call
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for seed in range(4):
        messages = long_conversation(seed, exchanges=12 + 6 * seed)
        encoded = masker.encode(messages, TOOLS)
        text, spans = encoded.rendering.text, encoded.rendering.spans
        assert encoded.input_ids == tok.encode(text, add_special_tokens=False)
        # A user's `<|im_end|>` is the special id on both paths, as the template's own.
        assert encoded.input_ids.count(im_end) == text.count("<|im_end|>") > len(messages)
        assert len(spans) == sum(m.role == "assistant" for m in messages) and len(encoded.input_ids) > 1500
        runs = supervised_runs(tok, encoded)
        assert runs == [text[a:b] for a, b in spans]  # the supervised tokens are exactly the spans


def test_kimi_user_lookalikes_are_special_ids_on_both_paths(tokenizers):
    """Verified, not assumed: tiktoken with special tokens allowed and the base class's added-token
    split both turn a user's `<|im_end|>` and `<think>` into their ids."""
    tok = tokenizers["kimi"]
    text = "a <|im_end|>b<think>c"
    assert tok.encode(text) == tok.encode(text, add_special_tokens=False)
    assert {163586, 163606} <= set(tok.encode(text))
