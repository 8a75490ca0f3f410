"""Constrained decoding: only tokens that keep the output inside a grammar (a JSON schema, or
a tool call's text) can be drawn.

llguidance builds the token mask: ``LLTokenizer`` reads the model's vocabulary (the
``tokenizers`` JSON moeswap.tokenizer builds from the GGUF, so the same bytes per id) and an
``LLMatcher`` follows one output, token by token. ``ConstrainedSampler`` wraps a request's
``Sampler``: before each draw every token the grammar forbids gets a logit of -inf (so
greedy, temperature, top-k/p, min-p and the repeat penalty all choose among allowed tokens),
and the drawn token moves the matcher on. When the grammar is complete only the model's stop
ids stay allowed, so the reply ends there with finish_reason "stop". Each request (each of
``n`` choices) has its own matcher, so it works in the batching loop unchanged.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from moeswap.errors import MoeswapError
from moeswap.sampling import Sampler, SamplingParams
from moeswap.tokenizer import Tokenizer

# Compact JSON: a small model given free whitespace can emit newlines until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


class GrammarError(MoeswapError):
    """Constrained decoding cannot be set up (a schema that does not compile, a vocabulary
    llguidance cannot read) or went wrong."""


def guidance_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance view of ``tokenizer``'s vocabulary, built once per tokenizer (seconds for a
    262k-token vocabulary); its end tokens are the model's stop ids."""
    with _tokenizers_lock:
        found = _tokenizers.get(tokenizer)
        if found is None:
            if not tokenizer.stop_ids:
                raise GrammarError("this model has no end-of-generation token, so a constrained "
                                   "reply could never end; fix the GGUF's tokenizer.ggml."
                                   "eos_token_id (moeswap fix MODEL --set ...)")
            try:
                found = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                               n_vocab=tokenizer.vocab_size,
                                               eos_token=sorted(tokenizer.stop_ids))
            except (ValueError, RuntimeError) as e:  # a vocabulary kind llguidance lacks
                raise GrammarError(f"constrained decoding cannot read this model's vocabulary "
                                   f"(llguidance: {e}); JSON output and forced tool calls are "
                                   "not available for it") from None
            _tokenizers[tokenizer] = found
        return found


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar for JSON that validates against ``schema``, laid out compactly."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except ValueError as e:
        raise GrammarError(f"not a JSON schema: {e}") from None


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammar:
    """A compiled grammar for one tokenizer; ``matcher()`` starts a fresh output."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        self.llg_tokenizer = guidance_tokenizer(tokenizer)
        self.vocab_size = tokenizer.vocab_size
        self.grammar = grammar
        error = llguidance.LLMatcher.validate_grammar(grammar, self.llg_tokenizer)
        if error:
            raise GrammarError(f"the schema cannot be compiled for constrained decoding "
                               f"(llguidance: {error.strip()}); JSON Schema's `not` and some "
                               "`format`s are not supported")

    def matcher(self) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.llg_tokenizer, self.grammar, log_level=0)

    def sampler_factory(self) -> Callable[[SamplingParams], ConstrainedSampler]:
        return lambda params: ConstrainedSampler(Sampler(params), self.matcher(), self.vocab_size)


class ConstrainedSampler:
    """A ``Sampler`` that draws only tokens its matcher allows (same ``next_token``)."""

    def __init__(self, sampler: Sampler, matcher: llguidance.LLMatcher, vocab_size: int):
        self.sampler = sampler
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.params = sampler.params

    def allowed(self, size: int) -> torch.Tensor:
        """[size] bool: the tokens the grammar allows next (ids past the vocabulary: none)."""
        if self.matcher.is_error():
            raise GrammarError(f"constrained decoding failed: {self.matcher.get_error()}")
        # one bit per token, token i at bit i % 32 of little-endian int32 word i // 32: in
        # bytes, bit i % 8 of byte i // 8
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [ceil(V/32) * 4]
        bits = np.unpackbits(packed, bitorder="little")[:min(size, self.vocab_size)]  # [<= size]
        allowed = torch.zeros(size, dtype=torch.bool)
        allowed[:len(bits)] = torch.from_numpy(bits.astype(bool))
        return allowed

    def next_token(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """logits: [V] of the next position, as ``Sampler.next_token``."""
        masked = logits.float().masked_fill(~self.allowed(logits.shape[-1]), float("-inf"))  # [V]
        token = self.sampler.next_token(masked, history)
        if not self.matcher.is_stopped():  # complete: the stop id ends the reply
            self.matcher.consume_token(token)
        return token


def response_format_grammar(response_format: dict[str, Any]) -> str | None:
    """The grammar of OpenAI's ``response_format`` (None: plain text)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("json_schema: give an object with a `schema` "
                               "object (and a `name`)")
        # OpenAI: no schema means any JSON object
        return json_schema_grammar(spec.get("schema") or {"type": "object"})
    raise GrammarError(f"type {json.dumps(kind)}: give text, json_object or "
                       "json_schema")
