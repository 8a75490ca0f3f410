"""Chat templates: the model's own Jinja template, rendered in a sandbox with limits.

A template comes from the model file, i.e. from whoever made it, so it runs in Jinja's
ImmutableSandboxedEnvironment: no access to private attributes (``__class__``,
``__subclasses__`` ...) and no mutation of the objects passed in. The globals and options are
those transformers' ``apply_chat_template`` gives templates, which is what they are written for,
less ``lipsum`` (a text generator no chat template needs, and an easy way to burn time).

Limits, each a ``ChatTemplateLimit`` naming it: the output (``MAX_OUTPUT`` characters, counted
as it is produced), ``*`` on strings and lists and ``**`` on numbers (their results are checked
before they are built), ``tojson``'s indent, and Jinja's own ``range`` limit. Time and memory
are the caller's to bound: the server renders in a child process (moeswap.server.template_worker).

Failures come in three kinds, as the server reports them: the template refused the messages
(its ``raise_exception``: the request's fault), it hit a limit, or it failed otherwise
(``1/0``, ``include``, recursion: the model file's fault).
"""

from __future__ import annotations

import json
import operator
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from moeswap.errors import MoeswapError

# A prompt longer than any context: 8 Mi characters.
MAX_OUTPUT = 8 * 2**20
MAX_INDENT = 64  # tojson(indent=...)
MAX_POWER_BITS = 4096  # ``a ** b`` results


class ChatTemplateError(MoeswapError):
    """The template cannot be compiled, or failed to render."""


class ChatTemplateRefused(ChatTemplateError):
    """The template's own ``raise_exception``: it does not accept these messages."""


class ChatTemplateLimit(ChatTemplateError):
    """The template went past a limit (output size, repeat, range, indent, time, memory) or
    tried something the sandbox stops."""


class ChatTemplateFailed(ChatTemplateError):
    """Any other failure while rendering: a fault of the template, not of the messages."""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 max_output: int = MAX_OUTPUT):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.max_output = max_output
        try:
            self._template = _environment(max_output).from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the chat template has a syntax error at line {e.lineno}: {e.message}; "
                "fix tokenizer.chat_template or pass another template") from None
        except Exception as e:  # e.g. a constant over Python's int-string limit
            raise ChatTemplateError(f"the chat template cannot be compiled: "
                                    f"{type(e).__name__}: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for ``messages`` (dicts with 'role' and 'content'); extra
        variables (``tools``, ``enable_thinking`` ...) are passed to the template as is."""
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token, **variables}
        pieces, size = [], 0
        try:
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > self.max_output:
                    raise ChatTemplateLimit(f"the chat template's output passed its limit of "
                                            f"{self.max_output} characters")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateLimit(f"the chat template tried an unsafe operation and was "
                                    f"stopped by the sandbox: {e}") from None
        except OverflowError as e:  # the sandbox's range limit, or a float too large
            raise ChatTemplateLimit(f"the chat template passed a limit: {e}") from None
        except MemoryError:
            raise ChatTemplateLimit("the chat template ran out of its memory limit") from None
        except Exception as e:
            raise ChatTemplateFailed(f"the chat template failed: {type(e).__name__}: {e}") from None
        return "".join(pieces)


def _raise_exception(message: str):
    raise ChatTemplateRefused(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    # transformers' version: unlike Jinja's own, it keeps non-ASCII text readable.
    if isinstance(indent, int) and indent > MAX_INDENT:
        raise ChatTemplateLimit(f"the chat template asked tojson for an indent of {indent}; "
                                f"the limit is {MAX_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _NoFolding(CodeGenerator):
    def _output_child_to_const(self, node, frame, finalize):
        # Jinja computes a constant ``{{ ... }}`` while compiling, even unoptimized:
        # ``'x' | center(3000000000)`` took 90 s and 3 GB at load, outside every limit.
        raise nodes.Impossible()


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})
    code_generator_class = _NoFolding

    def __init__(self, max_output: int, **options: Any):
        super().__init__(**options)
        self.max_output = max_output

    def unsafe_undefined(self, obj: Any, attribute: str):
        # Jinja's default renders a blocked attribute as an empty string; fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        # ``'a' * 3000000000`` would allocate 3 GB before the output limit sees it.
        if op == "*":
            sized, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(sized, (str, list, tuple)) and isinstance(count, int) \
                    and len(sized) * count > self.max_output:
                raise ChatTemplateLimit(f"the chat template repeated a {type(sized).__name__} "
                                        f"{count} times, past the limit of {self.max_output} items")
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise ChatTemplateLimit(f"the chat template computed {left} ** {right}, past the "
                                    f"limit of {MAX_POWER_BITS}-bit results")
        return operator.pow(left, right)


def _environment(max_output: int) -> ImmutableSandboxedEnvironment:
    # optimized=False: nor its optimizer (see _NoFolding)
    env = _Sandbox(max_output, trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                   optimized=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    del env.globals["lipsum"]
    return env
