"""Chat templates moeswap knows by name, for ``--chat-template NAME`` and for models that ship
none: ``plain`` is the fallback, the others are the usual formats of their families (the same
Jinja as the models' own ``tokenizer.chat_template``, rendered in the same sandbox)."""

from __future__ import annotations

from pathlib import Path

from moeswap.errors import MoeswapError

FALLBACK = "plain"
BUILT_IN = {
    # role: content lines, then the reply's role: any base model can continue it
    "plain": ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"),
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
               "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama3": ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
               "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
               "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "gemma": ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if "
              "message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role "
              "+ '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
}


def template_source(spec: str) -> str:
    """``--chat-template``'s value: a built-in NAME, or a file holding a Jinja template."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    path = Path(spec)
    if not path.is_file():
        raise MoeswapError(f"--chat-template {spec}: neither a file nor a built-in template "
                           f"({', '.join(BUILT_IN)})")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoeswapError(f"{path}: cannot read the chat template ({e}); give a UTF-8 Jinja "
                           "file") from None
