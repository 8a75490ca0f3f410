"""What a chat request asks beyond its messages: ``tools`` / ``tool_choice`` and
``response_format``, turned into the template's input, a grammar, and a tool-call parser.

- ``tools`` go to the template (moeswap.server.tool_prompts); with ``tool_choice`` "auto" (the
  default) the reply is parsed for calls (moeswap.server.tool_calls), "none" renders the tools
  but never parses a call, "required" or ``{"type": "function", "function": {"name": ...}}``
  force one call by constrained decoding.
- ``response_format`` json_object / json_schema constrain the reply to JSON (moeswap.server.
  constrained). Not together with tool calls (tool_choice other than "none"): a 400.
Every refusal is an OpenAI-shaped 400 naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeswap.server.api_errors import ApiError
from moeswap.server.constrained import (
    Grammar,
    GrammarError,
    lark_grammar,
    response_format_grammar,
)
from moeswap.server.schemas import ChatBody
from moeswap.server.tool_calls import tool_format
from moeswap.server.tool_prompts import (
    forced_call_lark,
    template_reads_tools,
    tool_template_input,
)


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict[str, Any]]  # the template's input
    variables: dict[str, Any]  # more template variables (tools)
    grammar: Grammar | None = None  # the reply is constrained to it
    tool_convention: str | None = None  # the reply is parsed for tool calls in it


def plan_chat(body: ChatBody, runtime: Any) -> ChatPlan:
    """Blocking (a grammar compiles in up to a second): call it off the event loop."""
    messages = [m.as_template_input() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice or "auto"
    named = None if isinstance(choice, str) else choice.function.name
    if not tools and (named or choice == "required"):
        raise ApiError(400, "tool_choice: a tool call was asked for but no `tools` were given",
                       param="tool_choice")
    if named and named not in [t["function"]["name"] for t in tools]:
        raise ApiError(400, f"tool_choice: no tool named `{named}` in `tools`", param="tool_choice")
    template = runtime.chat_template
    source = template.source if template is not None else ""
    convention = tool_format(source)
    has_history = any(m.get("tool_calls") for m in messages)
    if (tools or has_history) and convention is None:
        raise ApiError(400, "tools: this model's chat template writes tool calls in a form "
                            "moeswap cannot parse (it parses Hermes/Qwen <tool_call> and gpt-oss "
                            "harmony); serve it with --chat-template chatml (moeswap then "
                            "describes the tools in a system message)", param="tools",
                       code="unsupported_parameter")
    messages, variables = tool_template_input(messages, tools, template_reads_tools(source))
    calls_on = bool(tools) and choice != "none"
    wants_json = body.response_format is not None and body.response_format.type != "text"
    if wants_json and calls_on:
        raise ApiError(400, "response_format: JSON output together with tool calls is not "
                            "supported; send tool_choice \"none\" or leave out response_format",
                       param="response_format", code="unsupported_parameter")
    try:
        if named or choice == "required":
            forced = [t for t in tools if named in (None, t["function"]["name"])]
            grammar = Grammar(runtime.tokenizer, lark_grammar(forced_call_lark(forced, convention)))
        elif wants_json:
            grammar = Grammar(runtime.tokenizer, response_format_grammar(
                body.response_format.model_dump(by_alias=True)))
        else:
            grammar = None
    except GrammarError as e:
        param = "tools" if calls_on else "response_format"
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return ChatPlan(messages, variables, grammar, convention if calls_on else None)
