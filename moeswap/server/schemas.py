"""The request bodies the OpenAI-compatible endpoints accept, validated strictly.

Strict: a wrong JSON type ("max_tokens": "10", "stream": "yes") is a 400, not silently
converted. Unknown fields are ignored, as OpenAI clients send many optional ones; fields that
would change the output and are not built here (echo, best_of, tools, response_format,
logit_bias ...) are refused by name in ``unsupported_fields``.
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


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
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
