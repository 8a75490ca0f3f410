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
