"""Tools on the way in: what the chat template is given, and the grammar that forces a call.

A template that reads ``tools`` gets them as transformers passes them (``tools=[{"type":
"function", "function": {...}}]``), and earlier calls in the conversation with their
``arguments`` as objects (templates write them with ``tojson``). A template that never reads
``tools`` (the built-in ``plain`` one, ``chatml`` ...) gets the Hermes convention in words: a
system message listing the tools and the ``<tool_call>`` form, earlier calls written in that
form and tool results in ``<tool_response>``.

``tool_choice`` "required" or a named function forces one call by constrained decoding: a
grammar that admits only that convention's call text, with arguments valid against the tool's
``parameters`` schema.
"""

from __future__ import annotations

import json
from typing import Any

from moeswap.server.constrained import JSON_LAYOUT
from moeswap.server.tool_calls import HARMONY

HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_reads_tools(template_source: str) -> bool:
    return "tools" in template_source


def tool_template_input(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                        native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template variables) for a conversation with ``tools`` (may be empty) and
    maybe earlier calls; ``native``: the template reads ``tools`` itself."""
    if native:
        return [_with_object_arguments(m) for m in messages], ({"tools": tools} if tools else {})
    written = [_as_hermes_text(m) for m in messages]
    if not tools:
        return written, {}
    prompt = HERMES_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if written and written[0]["role"] in ("system", "developer"):
        first = written[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}] + written[1:], {}
    return [{"role": "system", "content": prompt}] + written, {}


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # the client's text, as it sent it


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
        for c in calls]}


def _as_hermes_text(message: dict[str, Any]) -> dict[str, Any]:
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return {"role": role, "content": content}
    blocks = [json.dumps({"name": c["function"]["name"],
                          "arguments": _arguments_object(c["function"]["arguments"])},
                         ensure_ascii=False) for c in calls]
    text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
    return {"role": role, "content": f"{content}\n{text}" if content else text}


def forced_call_lark(tools: list[dict[str, Any]], convention: str) -> str:
    """A Lark grammar (llguidance's dialect) admitting exactly one call of one of ``tools``."""
    def parameters(tool: dict) -> dict:
        return tool["function"].get("parameters") or {"type": "object"}

    if convention == HARMONY:
        rules = [f"call_{i}: <|channel|> {json.dumps('commentary to=functions.' + t['function']['name'] + ' ')} "
                 f"<|constrain|> \"json\" <|message|> args_{i}\n"
                 f"args_{i}: %json {json.dumps({**parameters(t), 'x-guidance': JSON_LAYOUT})}"
                 for i, t in enumerate(tools)]
        return "start: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "\n".join(rules)
    calls = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                        "properties": {"name": {"const": t["function"]["name"]},
                                       "arguments": parameters(t)}} for t in tools],
             "x-guidance": JSON_LAYOUT}
    return 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(calls)
