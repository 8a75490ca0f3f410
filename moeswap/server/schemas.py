"""The request bodies the OpenAI-compatible endpoints accept, validated strictly.

Strict: a wrong JSON type ("max_tokens": "10", "stream": "yes") is a 400, not silently
converted. Unknown fields are ignored, as OpenAI clients send many optional ones; fields that
would change the output and are not built here (echo, best_of, logit_bias, the legacy
functions ...) are refused by name in ``unsupported_fields``. Chat takes ``tools``,
``tool_choice`` and ``response_format`` (moeswap.server.chat_plan).
Sampling defaults are OpenAI's (temperature 1, top_p 1), not llama.cpp's; ``top_k``, ``min_p``
and ``repeat_penalty`` are llama-server's extensions, off by default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Sampling at a temperature this close to 0 is greedy decoding (its limit); dividing the
# logits by it would overflow float32 and make every probability NaN.
MIN_TEMPERATURE = 1e-3
UNSUPPORTED = ("echo", "best_of", "suffix", "logit_bias", "tools", "tool_choice", "functions",
               "function_call", "response_format")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def unsupported_fields(self) -> list[str]:
        extra = self.model_extra or {}
        return [name for name in UNSUPPORTED
                if extra.get(name) not in (None, False, 0, [], {}, "none", "auto")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class SamplingBody(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # under MIN_TEMPERATURE: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, ge=0.01, le=100.0)  # beyond: logits overflow
    seed: int | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None


class CompletionBody(SamplingBody):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token's and this many others'

    @property
    def logprob_alternatives(self) -> int | None:
        """Alternatives to report per token; None: no logprobs."""
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object's text


class ToolCallIn(_Strict):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        extra = {"tool_calls": [c.model_dump() for c in self.tool_calls]} if self.tool_calls else {}
        extra.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v})
        return {"role": self.role, "content": content or "", **extra}


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced call is always one
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def logprob_alternatives(self) -> int | None:
        """Alternatives to report per token; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def reply_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
