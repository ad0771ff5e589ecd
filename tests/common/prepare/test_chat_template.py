"""common/prepare/chat_template.py: the same text as `apply_chat_template` on the demo conversations
(chats and tool calls) for both miniature targets,
the sandbox refusing what it refused, and apply_chat_template's own errors off the common path."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import SecurityError
from transformers import AutoTokenizer

from common.defaults import demo_inputs
from common.prepare.chat_template import ChatTemplate
from common.prepare.conversations import to_conversation

VARIANTS = ({}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "thinking": False},
            {"preserve_thinking": True})


@pytest.mark.parametrize("kind", ["kimi", "flat"])
def test_renders_as_apply_chat_template(tokenizers, kind):
    tokenizer = tokenizers[kind]
    template = ChatTemplate(tokenizer)
    records = [json.loads(line) for path in demo_inputs() for line in path.read_text(encoding="utf-8").splitlines()]
    conversations = [to_conversation(str(i), r) for i, r in enumerate(records)]
    assert any(c.tools for c in conversations)  # tool declarations and tool calls are rendered too
    for c in conversations:
        messages = [m.to_template() for m in c.messages]
        for variables in VARIANTS:
            expected = tokenizer.apply_chat_template(messages, tools=c.tools, tokenize=False, **variables)
            assert template(messages, tools=c.tools, **variables) == expected


@pytest.mark.parametrize("unsafe", ["{{ messages.append(1) }}", "{% for m in messages %}{{ m.get('role') }}"
                                    "{{ m.clear() }}{% endfor %}", "{{ messages.__class__.__name__ }}"])
def test_sandbox_refuses_as_before(flat_target, unsafe):
    tokenizer = AutoTokenizer.from_pretrained(flat_target)
    tokenizer.chat_template = unsafe
    messages = [{"role": "user", "content": "hi"}]
    template = ChatTemplate(tokenizer)
    for render in (lambda: tokenizer.apply_chat_template(messages, tokenize=False), lambda: template(messages)):
        with pytest.raises(SecurityError):
            render()
    assert messages == [{"role": "user", "content": "hi"}]


# Calls inside loops and blocks (jinja passes their variables along with every call there): built-in
# methods, a macro, a macro with `caller`, the loop's own methods, a namespace, `str.format`, a global.
LOOP_TEMPLATE = """{%- macro wrap(text) -%}[{{ text.strip() }}|{{ caller() if caller else '' }}]{%- endmacro -%}
{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- set ns.n = ns.n + 1 -%}
  {{ loop.cycle('a', 'b') }}{{ m.get('role').upper() }}:{{ m['content'].split(' ') | join('_') }}
  {%- for key in m.keys() | sort -%}<{{ key.replace('e', 'E') }}>{%- endfor -%}
  {{ wrap(m.get('content', '')) }}{% call wrap('x') %}{{ loop.index }}{% endcall %}{{ '{}-{}'.format(ns.n, m.role) }}
{%- endfor -%}
{%- if messages | length > 9 -%}{{ raise_exception('too long') }}{%- endif -%}"""


def test_calls_inside_loops_render_as_before(flat_target):
    tokenizer = AutoTokenizer.from_pretrained(flat_target)
    tokenizer.chat_template = LOOP_TEMPLATE
    messages = [{"role": "user", "content": " hi there "}, {"role": "assistant", "content": "yes  it is"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ChatTemplate(tokenizer)(messages) == expected
    assert "aUSER:_hi_there_" in expected and "[x|2]2-assistant" in expected


def test_format_inside_a_loop_stays_sandboxed(flat_target):
    tokenizer = AutoTokenizer.from_pretrained(flat_target)
    tokenizer.chat_template = "{% for m in messages %}{{ '{0.__class__.__mro__}'.format(m) }}{% endfor %}"
    with pytest.raises(SecurityError):
        ChatTemplate(tokenizer)([{"role": "user", "content": "hi"}])


def test_apply_chat_template_errors_off_the_common_path(tokenizers):
    template = ChatTemplate(tokenizers["flat"])
    with pytest.raises(ValueError, match="Tools should either be a JSON schema"):
        template([{"role": "user", "content": "hi"}], tools=["not a schema"])
    with pytest.raises(IndexError):
        template([])
