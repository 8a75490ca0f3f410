"""Byte-level BPE pre-types transformers' GGUF converter does not know (DeepSeek-V3 / R1,
Kimi-K2, GLM-4.5's glm4 / glm5): token ids equal llama.cpp's on a fixed multilingual text and on
random mixtures; GLM's take a piece found whole in the vocabulary before merging.

No real DeepSeek-V3, Kimi-K2 or GLM-4.5 vocabulary is available offline (DeepSeek-V3's and
GLM-4.5's tokenizer.json and Kimi-K2's tiktoken.model are downloads; Kimi-K2's also needs its trust_remote_code tokenizer), so
each test trains a small byte-level BPE on the pre-type's own splits and writes it as a GGUF
vocabulary with ``tokenizer.ggml.pre`` set: the splitting and merging code is the real one, the
vocabulary a stand-in.
"""

from __future__ import annotations

import json
import random

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from moeswap.formats.byte_level_bpe import IGNORE_MERGES, SPLITS, byte_level_pre_tokenizer
from moeswap.tokenizer import load_tokenizer
from test_tokenizer import CONTROL, NORMAL, write_vocab_gguf

END = "<｜end▁of▁sentence｜>"
TEXT = ("def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "The quick brown fox didn't jump; it's 2024-06-15, 12345678 items at $3.50 each!\n"
        "混合专家模型把每个词元交给少数几个专家。深度求索发布了第三版。\n"
        "カタカナとひらがな、日本語のテキスト。  Ünïcödé naïve café — “quotes” …\n"
        "\t{\"key\": [1, 22, 333, 4444]}\r\n" + END + " after the end")
CORPUS = TEXT.split("\n") * 40 + ["hello world", "return x + y", "专家 模型 词元"] * 20


def trained_vocab_gguf(path, pre_type: str, extra_tokens: list[str] = ()):
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = byte_level_pre_tokenizer(pre_type)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END], show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get) + list(extra_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    types = [CONTROL if t == END else NORMAL for t in tokens]
    return write_vocab_gguf(path, tokens, [0.0] * len(tokens), types, model="gpt2", merges=merges,
                            extra={"add_tokenizer_pre": pre_type, "add_eos_token_id": 0})


@pytest.mark.llama_cpp
@pytest.mark.parametrize("pre_type", sorted(SPLITS))
def test_ids_equal_llama_cpps(tmp_path, pre_type):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = trained_vocab_gguf(tmp_path / f"{pre_type}.gguf", pre_type)
    ours = load_tokenizer(path, cache_dir=tmp_path / "cache")
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)

    def same(text: str) -> None:
        for special in (True, False):
            assert ours.encode(text, parse_special=special) == reference.tokenize(
                text.encode(), add_bos=True, special=special), (pre_type, repr(text))

    same(TEXT)
    assert len(ours.encode(TEXT)) < len(TEXT.encode()) // 2  # the merges are used
    rng = random.Random(7)
    pieces = [*"abcXYZ019 .,;'\n\t(){}", "专家", "模型", "カタ", "ひら", "é", "ü", "—", "“", "  ",
              "'s", "'LL", "123456", "fibonacci", "\r\n", END]
    for _ in range(300):
        same("".join(rng.choice(pieces) for _ in range(rng.randint(0, 20))))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("pre_type", sorted(IGNORE_MERGES))
def test_whole_word_in_the_vocabulary_is_one_token(tmp_path, pre_type):
    """GLM's pre-types (llama.cpp's ignore_merges): a piece found whole in the vocabulary is that
    token, even where no merges build it ("Ġqwzx" is appended with none)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = trained_vocab_gguf(tmp_path / f"{pre_type}.gguf", pre_type, extra_tokens=["Ġqwzx"])
    ours = load_tokenizer(path, cache_dir=tmp_path / "cache")
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    text = "say qwzx and qwzxq"
    assert ours.encode(text, parse_special=False) == reference.tokenize(
        text.encode(), add_bos=True, special=False)
    whole = [reference.n_vocab() - 1]  # the appended token's id
    assert ours.encode(" qwzx", parse_special=False) == whole
    assert reference.tokenize(b" qwzx", add_bos=False, special=False) == whole
