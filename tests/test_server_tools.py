"""tools / tool_choice and response_format on /v1/chat/completions (issue 24, items 5 and 6),
through the official `openai` client against a live server on 127.0.0.1, on the built-in
model: JSON by constrained decoding, tool calls forced by a grammar (the built-in model never
calls a tool by itself) or scripted, and clean 400s for what is not supported."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_server_live import serve_app
from test_tool_calls import TIME, WEATHER

import moeswap
from moeswap.chat_template import ChatTemplate
from moeswap.server.api_errors import ApiError
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from moeswap.server.chat_plan import plan_chat
from moeswap.server.schemas import ChatBody

openai = pytest.importorskip("openai", reason="the official client is what is being checked")

MODEL = "stdlib-moe"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "year", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["py", "c"]}}}}


@pytest.fixture(scope="module")
def runtime():
    return moeswap.load(moeswap.DEFAULT_MODEL, threads=1)


@pytest.fixture(scope="module")
def client(runtime):
    app = create_app(runtime, ServerOptions(MODEL, BatchOptions(ctx=512, max_batch=2)))
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def is_person(value) -> bool:
    """PERSON's constraints, checked by hand."""
    return (isinstance(value, dict) and set(value) == {"name", "year", "tags"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["year"]) is int and 1900 <= value["year"] <= 2100
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in ("py", "c") for t in value["tags"]))


def test_json_object_parses_in_a_batch_of_two(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "give me a JSON object"}], n=2,
        response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_output_validates_greedy_sampled_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "a person"}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                            max_tokens=120, temperature=0)
    assert is_person(json.loads(greedy.choices[0].message.content))
    sampled = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                             max_tokens=120, temperature=1.0, seed=7, n=2)
    for choice in sampled.choices:
        assert choice.finish_reason == "stop" and is_person(json.loads(choice.message.content))
    stream = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                            max_tokens=120, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == greedy.choices[0].message.content


def test_forced_tool_calls_whole_and_streamed(client):
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=80, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)

    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0.7, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)

    stream = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=80, temperature=0, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0
    assert (deltas[0][0].function.name, deltas[0][0].function.arguments) == \
        (required.choices[0].message.tool_calls[0].function.name,
         required.choices[0].message.tool_calls[0].function.arguments)
    assert stream[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_gives_no_tool_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice="none", max_tokens=12, temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content


class ScriptedSampler:
    """Draws a fixed text's tokens, then the stop id: a model that calls a tool by itself."""

    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tokenizer = None

    def __init__(self, params):
        self.params = params
        self.script = self.tokenizer.encode(self.text, add_special=False) + [self.tokenizer.eos_id]

    def next_token(self, logits, history):
        return self.script.pop(0)


def test_auto_parses_a_calling_models_reply(client, runtime, monkeypatch):
    monkeypatch.setattr(ScriptedSampler, "tokenizer", runtime.tokenizer)
    monkeypatch.setattr("moeswap.server.routes.Sampler", ScriptedSampler)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           max_tokens=80)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
    # the same reply streamed: content and the call come at its end
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                 max_tokens=80, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert [c.choices[0].delta.tool_calls[0].function.name for c in chunks
            if c.choices and c.choices[0].delta.tool_calls] == ["get_weather"]
    # without tools the same text is plain content
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80)
    assert plain.choices[0].message.content == ScriptedSampler.text
    assert plain.choices[0].message.tool_calls is None


def test_a_conversation_with_earlier_calls_renders(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                           tool_choice="none", max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
])
def test_unsupported_requests_get_an_openai_shaped_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param


def test_completions_still_refuse_response_format(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert caught.value.body["param"] == "response_format"


def test_a_template_with_another_call_format_is_refused_by_name(runtime):
    other = SimpleNamespace(tokenizer=runtime.tokenizer, chat_template=SimpleNamespace(
        source="{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"))
    body = ChatBody.model_validate({"model": MODEL, "messages": ASK, "tools": [WEATHER]})
    with pytest.raises(ApiError) as caught:
        plan_chat(body, other)
    assert caught.value.status == 400 and "--chat-template chatml" in str(caught.value)
    # without tools the same request is fine
    plan_chat(ChatBody.model_validate({"model": MODEL, "messages": ASK}), other)


# A template in the Qwen 2.5 style, written for this test: tools in the system turn, earlier
# calls with their arguments through tojson, results as <tool_response> in a user turn.
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nCall with <tool_call>JSON</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_reads_tools_gets_them_and_earlier_calls_as_objects(runtime):
    qwen = SimpleNamespace(tokenizer=runtime.tokenizer, chat_template=ChatTemplate(QWEN_STYLE))
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = ChatBody.model_validate({"model": MODEL, "messages": history, "tools": [WEATHER]})
    plan = plan_chat(body, qwen)
    assert plan.tool_convention == "hermes" and plan.grammar is None
    text = qwen.chat_template.render(plan.messages, **plan.variables)
    assert json.dumps(WEATHER) in text  # the tool as the client sent it
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # not a string
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.count("# Tools") == 1  # no second description in words
