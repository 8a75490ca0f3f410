"""Chat templates render exactly and cannot escape the sandbox."""

from __future__ import annotations

import pytest

from moeswap.chat_template import ChatTemplate, ChatTemplateError

# Gemma 3's template (text-only part), as published with the model.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CHATML = """{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""


def test_gemma3_template_renders_exactly():
    template = ChatTemplate(GEMMA3, bos_token="<bos>", eos_token="<eos>")
    text = template.render([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi "},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": "Name a colour."}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nName a colour.<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_chatml_without_generation_prompt():
    text = ChatTemplate(CHATML).render([{"role": "user", "content": "2+2?"}],
                                       add_generation_prompt=False)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n"


def test_raise_exception_becomes_a_clear_error():
    template = ChatTemplate(GEMMA3, bos_token="<bos>")
    with pytest.raises(ChatTemplateError, match="refused the messages: Conversation roles must alternate"):
        template.render([{"role": "assistant", "content": "I speak first."}])


def test_tojson_keeps_unicode_and_extra_variables_pass_through():
    template = ChatTemplate("{{ tools | tojson }}|{{ enable_thinking }}")
    assert template.render([], tools=[{"name": "天気"}], enable_thinking=False) == \
        '[{"name": "天気"}]|False'


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox_blocks_private_attribute_access(attack):
    with pytest.raises(ChatTemplateError, match="unsafe operation .* access to attribute '__"):
        ChatTemplate(attack).render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_subclasses_call():
    with pytest.raises(ChatTemplateError, match="unsafe operation"):
        ChatTemplate("{{ ().__class__.__base__.__subclasses__() }}").render([])


def test_sandbox_forbids_mutating_messages():
    with pytest.raises(ChatTemplateError, match="unsafe operation"):
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")


def test_constant_output_is_not_computed_while_compiling():
    """Jinja folds a constant ``{{ ... }}`` at compile time, outside every render limit:
    ``'x' | center(3000000000)`` took 90 s and 3 GB while a server loaded the model."""
    from moeswap.chat_template import _environment

    code = _environment(100).compile("{{ 'x' | center(30) }}", raw=True)
    assert "filters['center']" in code and repr("x".center(30)) not in code
    assert ChatTemplate("{{ 'x' | center(30) }}").render([]) == "x".center(30)


@pytest.mark.parametrize("source, words", [
    ("{{ ('a' * 3000000000) | length }}", "repeated a str 3000000000 times"),
    ("{{ [0] * 10**9 }}", "repeated a list"),
    ("{{ 7 ** 100000000 }}", "4096-bit"),
    ("{{ 1 | tojson(indent=10**9) }}", "indent of 1000000000"),
    ("{% for i in range(10**5) %}{{ 'xy' * 100 }}{% endfor %}", "output passed its limit"),
    ("{{ range(10**6) | list }}", "MAX_RANGE"),
])
def test_limits_are_named(source, words):
    from moeswap.chat_template import ChatTemplateLimit

    with pytest.raises(ChatTemplateLimit, match=words):
        ChatTemplate(source, max_output=10**6).render([])


def test_a_template_that_cannot_compile_is_one_error():
    with pytest.raises(ChatTemplateError, match="cannot be compiled: ValueError: Exceeds the limit"):
        ChatTemplate("{{ " + "9" * 5000 + " }}")
