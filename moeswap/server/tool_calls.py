"""Tool calls in a model's output, parsed into OpenAI's ``tool_calls``.

Two conventions, as the model's chat template teaches them (``tool_format``):
- ``hermes`` (Hermes, Qwen 2.5 / 3, and moeswap's own prompt for templates without tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``harmony`` (gpt-oss): a message addressed to a function,
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.
Parsing reads the reply with its special tokens spelled out. A block whose JSON does not parse
stays in the content, as text; a reply without calls is left as it is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES, HARMONY = "hermes", "harmony"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
# Qwen3-Coder's <function=NAME><parameter=...>, GLM-4.5's <arg_key>/<arg_value>
_XML_ARGUMENTS = ("<function=", "<arg_key>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        """OpenAI's tool call object (``index``: in a streamed delta)."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_format(template_source: str) -> str | None:
    """The tool-call convention a chat template teaches: HERMES, HARMONY, or None when it
    handles ``tools`` some other way. A template that never reads ``tools`` gets moeswap's
    Hermes prompt (moeswap.server.tool_prompts), so it is HERMES too."""
    if "to=functions." in template_source:
        return HARMONY
    if any(mark in template_source for mark in _XML_ARGUMENTS):
        return None  # <tool_call> around XML arguments, not JSON
    if "<tool_call>" in template_source or "tools" not in template_source:
        return HERMES
    return None


def parse_tool_calls(text: str, convention: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply's raw text. No calls: (text, [])."""
    parse = _parse_harmony if convention == HARMONY else _parse_hermes
    content, calls = parse(text)
    return (content, calls) if calls else (text, [])


def _call_from_json(text: str) -> ToolCall | None:
    """A Hermes call object ``{"name": ..., "arguments": ...}``, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls, kept, at = [], [], 0
    for block in _HERMES_BLOCK.finditer(text):
        call = _call_from_json(block.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[at:block.start()])
        at = block.end()
    content = ("".join(kept) + text[at:]).strip()
    return content or None, calls


def _parse_harmony(text: str) -> tuple[str | None, list[ToolCall]]:
    """Messages are ``[<|start|>ROLE]HEADER<|message|>BODY[END]``; a header naming
    ``to=functions.NAME`` makes the body that function's arguments; the ``final`` channel's
    body is the content."""
    calls, finals = [], []
    for message in text.split("<|start|>"):
        header, sep, body = message.partition("<|message|>")
        if not sep:
            continue
        for end in _HARMONY_ENDS:
            body = body.split(end, 1)[0]
        recipient = _HARMONY_RECIPIENT.search(header)
        channel = _HARMONY_CHANNEL.search(header)
        if recipient:
            args = body.strip()
            try:
                json.loads(args)
            except ValueError:
                continue
            calls.append(ToolCall(recipient.group(1), args))
        elif channel is not None and channel.group(1) == "final":
            finals.append(body.strip())
    return "\n".join(finals) or None, calls
