"""common/evaluate/prompts.py: held-out prompts end before the first supervised token; prompt-set
turns are rendered with the target's chat template, the second after the first's answer in the
same conversation; thinking mode changes Kimi's generation prompt and the default temperature,
and is refused on a template without a switch."""

from __future__ import annotations

import pytest
from datasets import Dataset

from common.errors import PipelineError
from common.evaluate.prompt_sets import PromptItem
from common.evaluate.prompts import ChatPrompter, ask_turns, decoding_mode, select_prompts, thinking_switch
from common.target.tokenizer import load_tokenizer

USER = [{"role": "user", "content": "Hello there"}]


def test_prompts_end_before_the_first_supervised_token():
    ds = Dataset.from_dict({
        "sample_id": ["a", "b", "c", "d"],
        "input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]],
        "loss_mask": [[0, 0, 1, 1], [1, 1, 1], [0, 0], [0, 1, 0]],
        "num_tokens": [4, 3, 2, 3],
    })
    prompts, skipped = select_prompts(ds, max_prompts=2)
    assert [(p.sample_id, p.ids) for p in prompts] == [("a", [1, 2]), ("d", [10])]
    assert skipped == 2  # "c" has no supervised token, "b" nothing before its first
    prompts, _ = select_prompts(ds, max_prompts=5, rows=[0, 3])
    assert [p.row for p in prompts] == [0, 3]
    assert {p.prompt_set for p in prompts} == {"held-out"}
    with pytest.raises(PipelineError, match="candidate"):
        select_prompts(ds, max_prompts=1, rows=[1, 2])


def test_kimi_modes_change_the_generation_prompt_and_temperature(kimi_target):
    tokenizer = load_tokenizer(kimi_target, trust_remote_code=True)
    assert thinking_switch(tokenizer)
    thinking, instant, default = (ChatPrompter(tokenizer, mode).render(USER) for mode in (True, False, None))
    assert thinking.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert instant.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert default == thinking  # Kimi-K2.5's template thinks unless told not to
    assert ChatPrompter(tokenizer, True).starts_in_thinking and not ChatPrompter(tokenizer, False).starts_in_thinking
    assert decoding_mode(tokenizer, True, None) == (True, 1.0)  # Kimi-K2.5's serving temperatures
    assert decoding_mode(tokenizer, False, None) == (False, 0.6)
    assert decoding_mode(tokenizer, False, 0.2) == (False, 0.2)  # --temperature wins
    assert decoding_mode(tokenizer, None, None) == (None, 0.0)  # no --thinking: greedy, as on held-out rows


def test_a_template_without_a_switch_stays_greedy_and_refuses_a_mode(flat_target):
    tokenizer = load_tokenizer(flat_target, trust_remote_code=False)
    assert not thinking_switch(tokenizer)
    assert decoding_mode(tokenizer, None, None) == (None, 0.0)
    with pytest.raises(PipelineError, match="--thinking off: the target's chat template has no thinking switch"):
        decoding_mode(tokenizer, False, None)


def test_the_answer_sent_back_is_the_content_without_the_think_block(kimi_target):
    tokenizer = load_tokenizer(kimi_target, trust_remote_code=True)
    prompter = ChatPrompter(tokenizer, True)
    tokens = tokenizer.encode("Let me see.</think>It is four.<|im_end|>", add_special_tokens=False)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert prompter.answer(tokens, stop) == {"role": "assistant", "content": "It is four."}
    cut = tokenizer.encode("Let me see, four", add_special_tokens=False)  # --max-new-tokens ended the think block
    assert prompter.answer(cut, stop) == {"role": "assistant", "content": "Let me see, four"}


def test_the_second_turn_follows_the_first_answer(flat_target):
    """ask_turns asks turn 2 only after turn 1 was answered, and renders that answer into it."""
    tokenizer = load_tokenizer(flat_target, trust_remote_code=False)
    prompter = ChatPrompter(tokenizer)
    sets = {"mt": [PromptItem("81", ("Write a haiku.", "Now make it rhyme."), "writing"),
                   PromptItem("82", ("One turn only.",), "math")],
            "he": [PromptItem("HumanEval/0", ("def f():",))]}
    asked = []

    def answer(prompts):
        asked.append([p.sample_id for p in prompts])
        return [tokenizer.encode(f"answer to {p.sample_id}", add_special_tokens=False) for p in prompts]

    prompts = ask_turns(sets, prompter, answer, stop_ids=set())
    assert asked == [["mt:81:1", "mt:82", "he:HumanEval/0"], ["mt:81:2"]]
    assert [(p.sample_id, p.row, p.prompt_set, p.category, p.turn) for p in prompts] == [
        ("mt:81:1", 0, "mt", "writing", 1), ("mt:81:2", 1, "mt", "writing", 2), ("mt:82", 2, "mt", "math", 1),
        ("he:HumanEval/0", 3, "he", None, 1)]
    first, second = (tokenizer.decode(p.ids) for p in prompts[:2])
    assert first == prompter.render([{"role": "user", "content": "Write a haiku."}])
    assert second == prompter.render([{"role": "user", "content": "Write a haiku."},
                                      {"role": "assistant", "content": "answer to mt:81:1"},
                                      {"role": "user", "content": "Now make it rhyme."}])
    assert second.startswith(first + "answer to mt:81:1")
