"""common/evaluate/measure.py: a draft that does not fit the target is refused before anything is
built; prompt-set turns decoded turn by turn, the second on the target's own first answer; every
k measured on the same prompts, each lossless."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import export_untrained

from common.errors import PipelineError
from common.evaluate.decoding import SamplingParams
from common.evaluate.measure import check_draft, measure_each_k, measure_plain_turns
from common.evaluate.prompt_sets import PromptItem
from common.evaluate.prompts import ChatPrompter
from common.evaluate.proposers import ngram_lookup
from common.target.config import load_target_info
from common.target.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
SETS = {"mt-bench": [PromptItem("81", ("Write a short poem about the sea.", "Now rewrite it as a limerick."),
                                "writing"),
                     PromptItem("111", ("What is 12 times 7?", "And divided by 4?"), "math")],
        "humaneval": [PromptItem("HumanEval/0", ("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",))]}
NEW_TOKENS = 12


def rewrite_config(draft: Path, out: Path, edit) -> Path:
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case, message", [
    ("hidden", "has hidden size 32, but target"),
    ("layers", "reads auxiliary layers [2, 4, 8], but target"),
    ("vocab", "maps a target vocabulary of"),
    ("not_speculators", "is not a speculators EAGLE-3 draft"),
    ("no_config", "no readable config.json"),
])
def test_draft_that_does_not_fit_is_refused(kimi_target, flat_target, tmp_path, case, message):
    draft = export_untrained(kimi_target, tmp_path / "untrained")
    folder = {
        "hidden": lambda: rewrite_config(draft, tmp_path / "d", lambda c: c["transformer_layer_config"].update(
            hidden_size=32)),
        "layers": lambda: rewrite_config(draft, tmp_path / "d", lambda c: c.update(
            eagle_aux_hidden_state_layer_ids=[2, 4, 8])),
        "vocab": lambda: export_untrained(flat_target, tmp_path / "d"),
        "not_speculators": lambda: kimi_target,
        "no_config": lambda: tmp_path,
    }[case]()
    with pytest.raises(PipelineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_draft(folder, load_target_info(kimi_target, trust_remote_code=True))



def ngram_passes(prompt: list[int], tokens: list[int], k: int) -> list[int]:
    """Drafts accepted per target pass when prompt lookup (n from 3 to 1) drafts k tokens over the
    prompt and greedy `tokens`, recounted from the tokens alone. The last pass may accept more:
    the target's choices past the budget or a stop token are not in `tokens`."""
    accepted, emitted = [], 1  # the prefill pass emits the first token and verifies nothing
    while emitted < len(tokens):
        proposal = ngram_lookup(prompt + tokens[:emitted], k, 1, 3)
        n = 0
        while n < len(proposal) and emitted + n < len(tokens) and proposal[n] == tokens[emitted + n]:
            n += 1
        accepted.append(n)
        emitted += n + 1
    return accepted


@pytest.fixture(scope="module")
def flat_turns(models, flat_target):
    """The flat miniature's plain greedy decoding of SETS, turn by turn."""
    model, info, _ = models["flat"]
    prompter = ChatPrompter(load_tokenizer(flat_target, trust_remote_code=False))
    prompts, plain = measure_plain_turns(model, SETS, prompter, NEW_TOKENS, set(info.stop_ids))
    return prompter, prompts, plain


def test_the_second_turn_sees_the_targets_own_first_answer(flat_turns, models):
    prompter, prompts, plain = flat_turns
    model, info, _ = models["flat"]
    assert [p.sample_id for p in prompts] == ["mt-bench:81:1", "mt-bench:81:2", "mt-bench:111:1", "mt-bench:111:2",
                                              "humaneval:HumanEval/0"]
    assert [p.category for p in prompts] == ["writing", "writing", "math", "math", None]
    decode = prompter.tokenizer.decode
    for (first, second), answer, item in zip(((prompts[0], prompts[1]), (prompts[2], prompts[3])), plain[::2],
                                             SETS["mt-bench"]):
        sent = prompter.answer(answer.tokens, info.stop_ids)["content"]
        # the target's own words (the miniature starts with a think block that 12 tokens do not close)
        assert sent.strip() and sent in decode(answer.tokens)
        assert decode(second.ids) == prompter.render([{"role": "user", "content": item.turns[0]},
                                                      {"role": "assistant", "content": sent},
                                                      {"role": "user", "content": item.turns[1]}])
        assert decode(second.ids).startswith(decode(first.ids) + sent)
    # the plain decoding of each turn is of that very prompt
    assert [g.prompt_len for g in plain] == [len(p.ids) for p in prompts]


def test_each_k_is_measured_on_the_same_prompts_and_is_lossless(flat_turns, models):
    _, prompts, plain = flat_turns
    model, info, draft = models["flat"]
    ks = [1, 3, 5]
    measured = measure_each_k(model, {"draft": draft}, prompts, plain, ks, NEW_TOKENS, set(info.stop_ids))
    assert set(measured) == {"draft", "ngram", "untrained"}
    for name, by_k in measured.items():
        assert list(by_k) == ks
        for k, result in by_k.items():
            assert result.identical_to_greedy, (name, k)
            assert [g.tokens for g in result.generations] == [g.tokens for g in plain]
            assert len(result.stats.acceptance_rate_per_position) == k
            assert 1.0 <= result.stats.acceptance_length <= 1 + k
    for k, result in measured["ngram"].items():  # the counts are the prompt lookup's own, pass by pass
        for prompt, generation in zip(prompts, result.generations):
            expected = ngram_passes(prompt.ids, generation.tokens, k)
            assert len(generation.accepted) == len(expected), (prompt.sample_id, k)
            assert generation.accepted[:-1] == expected[:-1], (prompt.sample_id, k)
            assert generation.accepted[-1:] >= expected[-1:], (prompt.sample_id, k)


def test_sampled_turns_are_not_compared_token_by_token(flat_turns, models):
    _, prompts, plain = flat_turns
    model, info, draft = models["flat"]
    measured = measure_each_k(model, {"draft": draft}, prompts[:1], plain[:1], [2], NEW_TOKENS, set(info.stop_ids),
                              SamplingParams(0.6), baselines=False)
    assert list(measured) == ["draft"] and measured["draft"][2].identical_to_greedy is None
