"""Chat templates: the model's own Jinja template, rendered in a sandbox.

A template comes from the model file, i.e. from whoever made it, so it runs in Jinja's
ImmutableSandboxedEnvironment: no access to private attributes (``__class__``,
``__subclasses__`` ...) and no mutation of the objects passed in. The globals and options are
those transformers' ``apply_chat_template`` gives templates, which is what they are written for.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from moeswap.errors import MoeswapError


class ChatTemplateError(MoeswapError):
    """The template failed to render, refused the messages, or tried something unsafe."""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the chat template has a syntax error at line {e.lineno}: {e.message}; "
                "fix tokenizer.chat_template or pass another template") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for ``messages`` (dicts with 'role' and 'content'); extra
        variables (``tools``, ``enable_thinking`` ...) are passed to the template as is."""
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token, **variables}
        try:
            return self._template.render(**context)
        except SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation and was "
                                    f"stopped by the sandbox: {e}") from None
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    # transformers' version: unlike Jinja's own, it keeps non-ASCII text readable.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str):
        # Jinja's default renders a blocked attribute as an empty string; fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
