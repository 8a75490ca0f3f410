"""Tokenizers from tiny GGUF vocabularies and HF folders, against llama.cpp's SPM algorithm
(a naive reference kept here) and, where installed, llama.cpp itself."""

from __future__ import annotations

import json
import random

import gguf
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from moeswap import tokenizer as tokenizer_module
from moeswap.errors import MoeswapError
from moeswap.tokenizer import load_tokenizer

BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def write_vocab_gguf(path, tokens, scores, types, *, model="llama", extra=None, merges=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_head_count(1)
    writer.add_feed_forward_length(8)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores([float(s) for s in scores])
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_spm_vocab(rng: random.Random, alphabet: str, n_merges: int):
    """Pieces built the way SentencePiece-BPE learns them: each new piece joins two old ones;
    the score is minus the merge order (as Gemma's and Llama's files store it)."""
    pieces = list(alphabet)
    while len(pieces) < len(alphabet) + n_merges:
        joined = rng.choice(pieces) + rng.choice(pieces)
        if joined not in pieces and len(joined) <= 6:
            pieces.append(joined)
    tokens = ["<unk>", "<s>", "</s>", "<|im_end|>"] + BYTE_TOKENS + pieces
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * (4 + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def spm_reference(text: str, tokens: list[str], scores: list[float], add_space_prefix: bool):
    """llama.cpp's llm_tokenizer_spm: merge the adjacent pair whose join is a token with the
    best score (leftmost on ties), then spell leftover symbols as byte tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    text = ((" " if add_space_prefix else "") + text).replace(" ", "▁")
    symbols = list(text)
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in ids and (best is None or scores[ids[joined]] > scores[ids[best[1]]]):
                best = (i, joined)
        if best is None:
            break
        i, joined = best
        symbols[i:i + 2] = [joined]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in symbol.encode())
    return out


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_spm_vocabulary_matches_reference_algorithm(tmp_path, cache_dir, add_space_prefix):
    rng = random.Random(7)
    tokens, scores, types = random_spm_vocab(rng, "▁abcd\n", 60)
    extra = {} if add_space_prefix else {"add_add_space_prefix": False}
    path = write_vocab_gguf(tmp_path / "spm.gguf", tokens, scores, types, extra=extra)
    tok = load_tokenizer(path, cache_dir=cache_dir)
    for _ in range(200):
        text = "".join(rng.choice("abcd \né") for _ in range(rng.randint(1, 24)))
        expected = [1] + spm_reference(text, tokens, scores, add_space_prefix)
        assert tok.encode(text) == expected, repr(text)
        assert tok.decode(tok.encode(text)) == text


def test_bos_eos_and_control_tokens(tmp_path, cache_dir):
    tokens, scores, types = random_spm_vocab(random.Random(1), "▁ab", 5)
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, scores, types,
                            extra={"add_add_bos_token": False, "add_add_eos_token": True,
                                   "add_add_space_prefix": False})
    tok = load_tokenizer(path, cache_dir=cache_dir)
    assert (tok.bos_id, tok.eos_id, tok.specials.add_bos, tok.specials.add_eos) == (1, 2, False, True)
    # </s> (eos) and <|im_end|> (by its text, as llama.cpp does) both end generation.
    assert tok.stop_ids == {2, 3}
    a = tokens.index("a")
    assert tok.encode("a<|im_end|>") == [a, 3, 2]
    assert tok.encode("a<|im_end|>", add_special=False) == [a, 3]
    literal = tok.encode("<|im_end|>", add_special=False, parse_special=False)
    assert 3 not in literal and tok.decode(literal) == "<|im_end|>"
    assert tok.decode([a, 3, 2]) == "a"
    assert tok.decode([a, 3], skip_special=False) == "a<|im_end|>"


def test_spm_defaults_when_keys_are_missing(tmp_path, cache_dir):
    tokens, scores, types = random_spm_vocab(random.Random(2), "▁ab", 5)
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, scores, types)
    tok = load_tokenizer(path, cache_dir=cache_dir)
    # llama.cpp's SPM defaults: bos 1, eos 2, add_bos on, add_eos off.
    assert (tok.bos_id, tok.eos_id, tok.specials.add_bos, tok.specials.add_eos) == (1, 2, True, False)


def test_user_defined_tokens_always_match(tmp_path, cache_dir):
    tokens, scores, types = random_spm_vocab(random.Random(3), "▁ab<>", 5)
    tokens.append("<tag>")
    scores.append(0.0)
    types.append(USER_DEFINED)
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, scores, types,
                            extra={"add_add_space_prefix": False})
    tok = load_tokenizer(path, cache_dir=cache_dir)
    tag = len(tokens) - 1
    for parse_special in (True, False):
        assert tag in tok.encode("a<tag>b", parse_special=parse_special)
    assert tok.decode(tok.encode("a<tag>b")) == "a<tag>b"


def test_cache_is_written_once_and_keyed_by_vocabulary(tmp_path, cache_dir, monkeypatch):
    tokens, scores, types = random_spm_vocab(random.Random(4), "▁ab", 8)
    first = write_vocab_gguf(tmp_path / "a.gguf", tokens, scores, types)
    expected = load_tokenizer(first, cache_dir=cache_dir).encode("ab ba")
    assert len(list(cache_dir.glob("*.json"))) == 1

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(first.read_bytes())

    def no_conversion(_):
        raise AssertionError("converted again although the cache holds this vocabulary")

    monkeypatch.setattr(tokenizer_module, "convert_gguf_vocabulary", no_conversion)
    assert load_tokenizer(copy, cache_dir=cache_dir).encode("ab ba") == expected

    changed_scores = scores[:-1] + [scores[-1] - 0.5]
    changed = write_vocab_gguf(tmp_path / "b.gguf", tokens, changed_scores, types)
    with pytest.raises(AssertionError, match="converted again"):
        load_tokenizer(changed, cache_dir=cache_dir)


def test_corrupt_cache_entry_is_rebuilt(tmp_path, cache_dir):
    tokens, scores, types = random_spm_vocab(random.Random(5), "▁ab", 8)
    path = write_vocab_gguf(tmp_path / "a.gguf", tokens, scores, types)
    expected = load_tokenizer(path, cache_dir=cache_dir).encode("abba")
    (entry,) = cache_dir.glob("*.json")
    entry.write_text("{not json")
    assert load_tokenizer(path, cache_dir=cache_dir).encode("abba") == expected


def test_byte_level_bpe_vocabulary(tmp_path, cache_dir):
    # GPT-2 spelling: "Ġ" is the space byte.
    tokens = ["<|endoftext|>", "h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "llo", "hello",
              "Ġw", "or", "Ġwor", "Ġworld"]
    merges = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens.insert(9, "ld")
    types = [CONTROL] + [NORMAL] * (len(tokens) - 1)
    path = write_vocab_gguf(tmp_path / "bpe.gguf", tokens, [0.0] * len(tokens), types,
                            model="gpt2", merges=merges,
                            extra={"add_tokenizer_pre": "qwen2", "add_eos_token_id": 0})
    tok = load_tokenizer(path, cache_dir=cache_dir)
    assert tok.encode("hello world") == [tokens.index("hello"), tokens.index("Ġworld")]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert (tok.bos_id, tok.specials.add_bos, tok.stop_ids) == (None, False, {0})


def test_unknown_tokenizer_model_is_a_clear_error(tmp_path, cache_dir):
    path = write_vocab_gguf(tmp_path / "u.gguf", ["a"], [0.0], [NORMAL], model="rwkv")
    with pytest.raises(MoeswapError, match="tokenizer.ggml.model is 'rwkv'"):
        load_tokenizer(path, cache_dir=cache_dir)


def test_hf_folder(tmp_path):
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2, "a": 3, "b": 4, "ab": 5}
    backend = tokenizers.Tokenizer(models.BPE(vocab, [("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.BPEDecoder()
    backend.add_special_tokens(["<s>", "</s>", "<|eot|>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": "{{ messages }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("ab") == [0, 5]
    assert tok.encode("ab", add_special=False) == [5]
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.specials.add_bos) == (0, 1, {1, 2}, True)
    assert tok.chat_template == "{{ messages }}"


def test_hf_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(MoeswapError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)


def test_hf_folder_with_only_a_sentencepiece_model(tmp_path):
    import sentencepiece
    import tiny_models

    tiny_models.save("mixtral", tmp_path)
    tok = load_tokenizer(tmp_path, cache_dir=tmp_path / "cache")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    text = "Hello world, experts route tokens."
    assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.specials.add_bos) == (1, 2, True)
    assert len(list((tmp_path / "cache").glob("*.gguf"))) == 1  # the vocabulary, cached


def test_text_stream_waits_for_whole_characters(tmp_path, cache_dir):
    tokens, scores, types = random_spm_vocab(random.Random(6), "▁ab", 5)
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, scores, types,
                            extra={"add_add_space_prefix": False})
    tok = load_tokenizer(path, cache_dir=cache_dir)
    ids = tok.encode("a é b", add_special=False)  # é is two byte tokens
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == "a é b"
    assert "" in pieces  # the first byte of é alone yields nothing


def test_text_stream_primed_with_the_prompt_keeps_leading_spaces(tmp_path, cache_dir):
    tokens, scores, types = random_spm_vocab(random.Random(8), "▁ab", 6)
    path = write_vocab_gguf(tmp_path / "v.gguf", tokens, scores, types)  # with prefix space
    tok = load_tokenizer(path, cache_dir=cache_dir)
    full = tok.encode("ab ba b", add_special=False)
    text = tok.decode(full)
    unprimed_differs = False
    for k in range(1, len(full)):
        primed = tok.stream(full[:k])
        streamed = "".join(primed.push(i) for i in full[k:])
        assert streamed == text[len(tok.decode(full[:k])):], k
        unprimed = tok.stream()
        unprimed_differs |= "".join(unprimed.push(i) for i in full[k:]) != streamed
    assert unprimed_differs  # decoding alone strips the space: priming matters


@pytest.mark.llama_cpp
def test_random_texts_match_llama_cpp(tmp_path, cache_dir):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    rng = random.Random(11)
    tokens, scores, types = random_spm_vocab(rng, "▁abcd\n", 80)
    path = write_vocab_gguf(tmp_path / "spm.gguf", tokens, scores, types)
    tok = load_tokenizer(path, cache_dir=cache_dir)
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for _ in range(300):
        text = "".join(rng.choice(["a", "b", "c", "d", " ", "\n", "é", "<|im_end|>", "</s>"])
                       for _ in range(rng.randint(0, 20)))
        for parse_special in (True, False):
            assert tok.encode(text, parse_special=parse_special) == reference.tokenize(
                text.encode(), add_bos=True, special=parse_special), repr(text)


@pytest.mark.llama_cpp
def test_byte_level_bpe_matches_llama_cpp(tmp_path, cache_dir):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from tokenizers import trainers

    corpus = ["The quick brown fox jumps over the lazy dog.", "def add(a, b): return a + b",
              "Hello world 123 4567!", "naïve café 日本語"] * 50
    trained = tokenizers.Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"], show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    types = [CONTROL if t == "<|endoftext|>" else NORMAL for t in tokens]
    path = write_vocab_gguf(tmp_path / "bpe.gguf", tokens, [0.0] * len(tokens), types,
                            model="gpt2", merges=merges,
                            extra={"add_tokenizer_pre": "qwen2", "add_eos_token_id": 0})
    tok = load_tokenizer(path, cache_dir=cache_dir)
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    rng = random.Random(12)
    pieces = list("The quick brown fox 0123456789 def add(a, b): return!?' \n\t") + \
        ["café", "日本", "  ", "\n\n", "<|endoftext|>", "'s", "'ll"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))
        for parse_special in (True, False):
            # add_bos=True asks for llama.cpp's own BOS decision (off for this vocabulary)
            assert tok.encode(text, parse_special=parse_special) == reference.tokenize(
                text.encode(), add_bos=True, special=parse_special), repr(text)
