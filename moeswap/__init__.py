"""moeswap: run Mixture-of-Experts models on machines whose fast memory cannot hold them."""


def load(path, **runtime_options):
    """Open a model (.gguf file or Hugging Face folder): a ``moeswap.runtime.Runtime`` with
    ``.tokenizer``, ``.forward_logits(ids)``, ``.generate(prompt, max_tokens=...)`` and
    ``.chat_template``. Options: see ``moeswap.runtime.load``."""
    from moeswap.runtime import load as load_runtime  # torch loads only when a model does

    return load_runtime(path, **runtime_options)
