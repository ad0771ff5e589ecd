"""The tokenizer's chat template, rendered as `tokenizer.apply_chat_template(..., tokenize=False)` does,
at a fraction of its per-call cost (rendering is most of step 01's time on long conversations).

`apply_chat_template` rebuilds `special_tokens_map` on every call (a property that walks the
tokenizer's special tokens) and validates its arguments; both are the same for every conversation
of a run, so here they are computed once. Inside the template, jinja's immutable sandbox checks
every attribute access (`m.get`, `loop.index0`) with `is_safe_attribute`, a chain of isinstance
tests that was a third of the rendering's time. For `ImmutableSandboxedEnvironment` that answer
depends only on the object's type and the attribute's name (`is_internal_attribute` and
`modifies_known_mutable` test the type only), so it is kept per (type, name); and a call of a
built-in method (`m.get(...)`) skips the sandbox's and the context's look-ups for markers a
built-in cannot carry. The same accesses and calls are allowed and refused as before, and the output is the same. The template is compiled by
transformers (its filters, globals and extensions), then recompiled in an overlay of that
environment, so transformers' own cached template is left untouched.

Anything off the common path (an empty conversation, a tool that is not a JSON schema dict)
goes through `apply_chat_template` itself, so its errors stay its own.
"""

from __future__ import annotations

from functools import lru_cache
from types import BuiltinMethodType

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils.chat_template_utils import _compile_jinja_template

__all__ = ["ChatTemplate"]


class ChatTemplate:
    """`template(messages, tools, add_generation_prompt, **variables)`: the text
    `tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)` renders."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The tokenizer does not change during a run; apply_chat_template recomputes this per call.
        self.special_tokens = dict(tokenizer.special_tokens_map)

    def __call__(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
                 **variables) -> str:
        if not messages or (tools is not None and not all(isinstance(t, dict) for t in tools)):
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **variables)
        source = self.tokenizer.get_chat_template(None, tools)  # a tokenizer may keep a tool_use template
        return _compiled(source).render(messages=messages, tools=None if tools is None else list(tools),
                                        documents=None, add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **variables})


@lru_cache(maxsize=8)
def _compiled(source: str) -> Template:
    """`source` compiled as transformers compiles it, in an environment whose sandbox checks are kept."""
    environment = _compile_jinja_template(source).environment.overlay()
    if type(environment) is ImmutableSandboxedEnvironment:  # a subclass may check more than the type
        environment.is_safe_attribute = _kept_checks(environment.is_safe_attribute)
        environment.call = _builtins_called_directly(environment.call)
    return environment.from_string(source)


def _kept_checks(is_safe_attribute):
    """`is_safe_attribute(obj, attr, value)` kept per (type of obj, attr): for the immutable sandbox
    it depends on nothing else."""
    kept: dict[tuple[type, str], bool] = {}

    def check(obj, attr: str, value) -> bool:
        key = (type(obj), attr)
        safe = kept.get(key)
        if safe is None:
            safe = kept[key] = is_safe_attribute(obj, attr, value)
        return safe

    return check


def _builtins_called_directly(call):
    """The sandbox's `call(context, obj, *args, **kwargs)`, for a built-in method (`m.get(...)`, the
    template's most frequent call) made as jinja makes it without the look-ups that cannot find
    anything on one: `is_safe_callable`'s `unsafe_callable`/`alters_data` markers and `Context.call`'s
    `jinja_pass_arg` (a built-in method has no instance attributes and its type defines none)."""
    def direct(context, obj, /, *args, **kwargs):
        if type(obj) is not BuiltinMethodType:
            return call(context, obj, *args, **kwargs)
        # Inside a loop or block jinja passes its variables along (nearly every call of a chat
        # template); Context.call hands them only to a pass_context callable, so it drops them here.
        kwargs.pop("_loop_vars", None)
        kwargs.pop("_block_vars", None)
        try:
            return obj(*args, **kwargs)
        except StopIteration:  # as Context.call answers it
            return context.environment.undefined("value was undefined because a callable raised a"
                                                 " StopIteration exception")

    return direct
