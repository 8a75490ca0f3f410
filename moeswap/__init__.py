"""moeswap: run Mixture-of-Experts models on machines whose fast memory cannot hold them."""

from pathlib import Path

# The built-in default model: a small Mixtral-family MoE trained by training/train.py on the
# Python standard library's source (docs/MODEL.md).
DEFAULT_MODEL = Path(__file__).parent / "data" / "stdlib-moe-q8_0.gguf"


def load(path, **runtime_options):
    """Open a model (.gguf file or Hugging Face folder): a ``moeswap.runtime.Runtime`` with
    ``.tokenizer``, ``.forward_logits(ids)``, ``.generate(prompt, max_tokens=...)`` and
    ``.chat_template``. Options: see ``moeswap.runtime.load``."""
    from moeswap.runtime import load as load_runtime  # torch loads only when a model does

    return load_runtime(path, **runtime_options)
