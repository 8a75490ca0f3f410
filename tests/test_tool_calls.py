"""Tool calls parsed from fixed model outputs (Hermes/Qwen and gpt-oss harmony), the template
input for tools, and the grammars that force a call or JSON (issue 24, items 5 and 6). The live
server's side is tests/test_server_tools.py."""

from __future__ import annotations

import asyncio
import json

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from moeswap.sampling import GREEDY
from moeswap.server.choices import Piece
from moeswap.server.constrained import Grammar, lark_grammar, response_format_grammar
from moeswap.server.tool_calls import HARMONY, HERMES, parse_tool_calls, tool_format
from moeswap.server.tool_pieces import MARK, ToolCallPieces
from moeswap.server.tool_prompts import forced_call_lark, tool_template_input
from moeswap.template_library import BUILT_IN
from moeswap.tokenizer import SpecialTokens, Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|call|>", "<|return|>"]


def test_hermes_calls_with_content_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
            "</tool_call>")
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    call = calls[0].as_openai()
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0].as_openai(index=1)["index"] == 1


def test_hermes_edge_cases():
    only = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(only, HERMES)[0] is None  # nothing beside the call
    assert parse_tool_calls(only, HERMES)[1][0].arguments == '{"a": 1}'  # already a string
    cut = '<tool_call>\n{"name": "f", "arguments": {}}'  # ended at a stop id, no closing tag
    assert parse_tool_calls(cut, HERMES)[1][0].name == "f"
    broken = "Sure <tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, HERMES) == (broken, [])
    assert parse_tool_calls("plain answer", HERMES) == ("plain answer", [])


def test_harmony_call_after_analysis_and_final_content():
    text = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}<|call|>')
    content, calls = parse_tool_calls(text, HARMONY)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    # the recipient before the channel, the call cut at its stop token (<|call|> is one)
    other = ("<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
             '{"zone": "UTC"}')
    assert parse_tool_calls(other, HARMONY)[1][0].name == "get_time"
    final = "<|channel|>final<|message|>It is sunny.<|return|>"
    assert parse_tool_calls(final, HARMONY) == (final, [])  # no call: the reply as it was
    with_final = ("<|channel|>final<|message|>Checking.<|end|><|start|>assistant<|channel|>"
                  'commentary to=functions.f <|constrain|>json<|message|>{}')
    assert parse_tool_calls(with_final, HARMONY)[0] == "Checking."


def test_tool_format_from_the_template():
    assert tool_format("{{ '<tool_call>' }}{% if tools %}{% endif %}") == HERMES
    assert tool_format("{% if tools %}to=functions.{{ name }}{% endif %}") == HARMONY
    assert tool_format(BUILT_IN["plain"]) == HERMES  # no tools in it: moeswap's prompt
    assert tool_format("{% if tools %}[TOOL_CALLS]{% endif %}") is None  # another convention
    assert tool_format("{% if tools %}<tool_call>\n<function={{ n }}>{% endif %}") is None  # XML


def test_template_input_native_and_in_words():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    native, variables = tool_template_input(history, [WEATHER], native=True)
    assert variables == {"tools": [WEATHER]}
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    words, variables = tool_template_input(history, [WEATHER], native=False)
    assert variables == {}
    assert words[0]["role"] == "system" and json.dumps(WEATHER) in words[0]["content"]
    assert "<tool_call>" in words[0]["content"]
    assert words[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Paris"}}\n</tool_call>')
    assert words[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    system = tool_template_input([{"role": "system", "content": "Be brief."}] + history,
                                 [WEATHER], native=False)[0]
    assert system[0]["content"].startswith("Be brief.\n\n# Tools")  # merged, not a second one


def byte_tokenizer(specials: list[str]) -> Tokenizer:
    """A byte-level vocabulary (one token per byte) with ``specials`` as control tokens, the
    first of them the end of generation."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    stop = backend.token_to_id(specials[0])
    return Tokenizer(backend, SpecialTokens(None, stop, frozenset({stop}), False, False), None)


def accepts(grammar: Grammar, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens whole and may end after them."""
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_special=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


def test_forced_call_grammars_take_only_a_valid_call():
    hermes_tok = byte_tokenizer(["<|im_end|>"])
    grammar = Grammar(hermes_tok, lark_grammar(forced_call_lark([WEATHER, TIME], HERMES)))
    assert accepts(grammar, hermes_tok, '<tool_call>\n{"name": "get_time", "arguments": '
                                        '{"zone": "CET"}}\n</tool_call>')
    assert not accepts(grammar, hermes_tok, '<tool_call>\n{"name": "get_time", "arguments": '
                                            '{"city": "Paris"}}\n</tool_call>')  # not its schema
    assert not accepts(grammar, hermes_tok, "Sure!")

    harmony_tok = byte_tokenizer(["<|call|>"] + HARMONY_SPECIALS)
    grammar = Grammar(harmony_tok, lark_grammar(forced_call_lark([WEATHER], HARMONY)))
    assert accepts(grammar, harmony_tok, '<|channel|>commentary to=functions.get_weather '
                                         '<|constrain|>json<|message|>{"city": "Paris"}')
    assert not accepts(grammar, harmony_tok, "<|channel|>final<|message|>Hi")


def test_response_format_grammars():
    tok = byte_tokenizer(["</s>"])
    any_object = Grammar(tok, response_format_grammar({"type": "json_object"}))
    assert accepts(any_object, tok, '{"a": [1, 2]}')
    assert not accepts(any_object, tok, "[1, 2]")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    typed = Grammar(tok, response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    assert accepts(typed, tok, '{"n": 3}')
    assert not accepts(typed, tok, '{"n": "3"}')
    assert response_format_grammar({"type": "text"}) is None


def test_the_mask_keeps_the_best_allowed_token_and_ends_on_the_stop_id():
    tok = byte_tokenizer(["</s>"])
    grammar = Grammar(tok, response_format_grammar({"type": "json_object"}))
    sampler = grammar.sampler_factory()(GREEDY)
    size = tok.vocab_size + 3  # a model's output row may be wider than its vocabulary
    logits = torch.zeros(size)
    logits[tok.encode("x", add_special=False)[0]] = 9.0  # the model's favourite: not JSON
    logits[tok.encode("{", add_special=False)[0]] = 1.0
    logits[size - 1] = 99.0  # past the vocabulary: never drawn
    assert tok.decode([sampler.next_token(logits, [])]) == "{"
    allowed = sampler.allowed(size)
    assert [tok.decode([int(i)]) for i in allowed.nonzero()] == ["\"", "}"]
    logits[tok.encode("}", add_special=False)[0]] = 5.0
    assert tok.decode([sampler.next_token(logits, [])]) == "}"
    assert sampler.allowed(size).nonzero().flatten().tolist() == [tok.eos_id]
    assert sampler.next_token(logits, []) == tok.eos_id


class FakeChoices:
    """Pieces of one choice as the batching loop would send them, the last with every id."""

    def __init__(self, tokenizer: Tokenizer, texts: list[str]):
        self.texts, self.ids = texts, tokenizer.encode("".join(texts), add_special=False)

    def cancel(self) -> None:
        pass

    async def pieces(self):
        for text in self.texts[:-1]:
            yield Piece(0, text)
        yield Piece(0, self.texts[-1], "stop", ids=tuple(self.ids))


def streamed(tokenizer: Tokenizer, texts: list[str], convention: str = HERMES) -> list[Piece]:
    async def collect():
        return [p async for p in ToolCallPieces(FakeChoices(tokenizer, texts), tokenizer,
                                                convention).pieces()]
    return asyncio.run(collect())


def test_text_streams_until_a_call_begins():
    tok = byte_tokenizer(["</s>"])
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    pieces = streamed(tok, ["Let me", " look. \n<tool", "_call>", call[len(MARK):]])
    assert [p.text for p in pieces] == ["Let me", " look.", ""]  # the space and newline dropped
    assert pieces[-1].finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in pieces[-1].tool_calls] == [("f", '{"a": 1}')]
    plain = streamed(tok, ["a <tool", " b  ", "c\n"])  # looked like a call's start, was not
    assert "".join(p.text for p in plain) == "a <tool b  c\n"
    assert plain[-1].finish_reason == "stop" and not plain[-1].tool_calls
    broken = streamed(tok, ["x ", "<tool_call>{oops}"])  # kept as content
    assert "".join(p.text for p in broken) == "x <tool_call>{oops}"


def test_harmony_replies_are_held_and_parsed_from_their_tokens():
    tok = byte_tokenizer(["<|call|>"] + HARMONY_SPECIALS)
    text = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
    pieces = streamed(tok, [text[:20], text[20:]], HARMONY)
    assert [p.text for p in pieces] == [""]
    assert pieces[0].tool_calls[0].name == "f" and pieces[0].finish_reason == "tool_calls"
