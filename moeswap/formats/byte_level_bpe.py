"""Where llama.cpp's byte-level BPE (``tokenizer.ggml.model = gpt2``) differs from what
transformers' GGUF tokenizer converter builds: the ``tokenizer.ggml.pre`` types it does not know,
and control tokens written as plain text.

llama.cpp (src/llama-vocab.cpp, ``llm_tokenizer_bpe``) applies a pre-type's regexes one after
the other, each cutting the pieces the previous one left into its matches and the text between
them; ``tokenizers``' ``Split(..., behavior="isolated")`` in a ``Sequence`` does the same. Then
every piece is spelled in the GPT-2 byte alphabet and merged.
"""

from __future__ import annotations

import json

import tokenizers
from tokenizers import Regex, pre_tokenizers

TOKEN_TYPE_CONTROL = 3

# DeepSeek-V3 / R1 (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM): digits in threes, runs of CJK and kana,
# then words, punctuation and whitespace; the regexes of its tokenizer.json.
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Kimi-K2 (LLAMA_VOCAB_PRE_TYPE_KIMI_K2): its tiktoken pattern (tokenization_kimi.py), which
# llama.cpp computes by hand (unicode_regex_split_custom_kimi_k2): Han runs, then GPT-4o-style
# words that exclude Han, digits in threes, punctuation and whitespace.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_KIMI_K2 = (
    r"[\p{Han}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTIONS}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTIONS}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# GLM-4.5 / 4.6 / 4.7 and GLM-5 (pre "glm4" / "glm5", LLAMA_VOCAB_PRE_TYPE_CHATGLM4): GPT-4-style
# words, digits in threes, punctuation and whitespace.
_GLM4 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# Llama 4 (pre "llama4", LLAMA_VOCAB_PRE_TYPE_GPT4O): GPT-4o's pattern as llama.cpp rewrites it,
# its letter-case classes turned into "a letter but not a-z" / "a letter but not A-Z" (so every
# non-ASCII letter counts as both cases, and marks as none); digits in threes; punctuation with
# its trailing newlines or slashes.
_CASED_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CASED_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CASED_CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": _KIMI_K2,
    "glm4": _GLM4,
    "glm5": _GLM4,
    "llama4": _GPT4O,
}
# Pre-types for which llama.cpp takes a piece found whole in the vocabulary as that one token
# before merging (ignore_merges; tokenizers' BPE option of the same name).
IGNORE_MERGES = frozenset({"glm4", "glm5"})


def byte_level_pre_tokenizer(pre_type: str) -> pre_tokenizers.PreTokenizer:
    """The pre-type's splits in order, then the GPT-2 byte alphabet (no prefix space)."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in SPLITS[pre_type]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def keep_plain_text_control_tokens(backend: tokenizers.Tokenizer, tokens: list[str],
                                   types: list[int] | None) -> tokenizers.Tokenizer:
    """Control tokens the file spells as plain text, not in the byte alphabet (DeepSeek's
    ``<｜end▁of▁sentence｜>``): llama.cpp matches them whole at their own ids; transformers'
    converter leaves them out (as mislabels) and its vocabulary holds their byte spelling.
    The vocabulary entry takes the plain text back, and the token is added as special."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    plain = {i: text for i, (text, kind) in enumerate(zip(tokens, types or ()))
             if kind == TOKEN_TYPE_CONTROL and not set(text) <= alphabet}
    if not plain:
        return backend
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    by_id = {i: text for text, i in vocab.items() if i in plain}
    for i, text in plain.items():
        vocab.pop(by_id.get(i, text), None)
        vocab[text] = i
        spec["added_tokens"].append({"id": i, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    return tokenizers.Tokenizer.from_str(json.dumps(spec))
