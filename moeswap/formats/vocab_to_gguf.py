"""Write a HF folder's tokenizer into GGUF metadata (``tokenizer.ggml.*``), as llama.cpp's
convert_hf_to_gguf.py does for these families' usual tokenizers:

- ``tokenizer.model`` (SentencePiece: Mixtral, Gemma 3) -> model "llama", pieces, scores, types;
- otherwise ``tokenizer.json`` with a BPE model (Qwen, OLMoE, Granite) -> model "gpt2", tokens,
  types and merges. llama.cpp picks the BPE pre-tokenizer by hashing how the tokenizer splits a
  probe text; moeswap recognises GPT-2's own byte-level split from tokenizer.json's
  structure (``gpt-2``, e.g. the built-in model's tokenizer) and otherwise names the
  pre-tokenizer of the family's published tokenizer (``BPE_PRE_TOKENIZERS``).

Special tokens, add_bos/add_eos and the chat template come from gguf-py's ``SpecialVocab``,
the same code the reference converter calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from moeswap.errors import MoeswapError
from moeswap.formats.config import ModelConfig

# The pre-tokenizer llama.cpp detects for each family's published BPE tokenizer.
BPE_PRE_TOKENIZERS = {"qwen2moe": "qwen2", "qwen3moe": "qwen2", "olmoe": "olmo",
                      "granitemoe": "refact", "llama": "llama-bpe", "gemma3": "default"}


def _bpe_pre_tokenizer(spec: dict, config: ModelConfig) -> str:
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # byte-level BPE split by GPT-2's regex alone
    return BPE_PRE_TOKENIZERS[config.arch]


def write_vocab(writer: gguf.GGUFWriter, folder: Path, config: ModelConfig) -> int:
    """Add the tokenizer keys; returns the number of tokens written."""
    if (folder / "tokenizer.model").is_file():
        tokens = _sentencepiece(writer, folder, config)
    elif (folder / "tokenizer.json").is_file():
        tokens = _bpe(writer, folder, config)
    else:
        raise MoeswapError(f"{folder}: no tokenizer.model or tokenizer.json; "
                           "the GGUF needs the tokenizer in its metadata")
    if config.arch == "gemma3":
        writer.add_add_space_prefix(False)
    else:
        add_prefix = _tokenizer_config(folder).get("add_prefix_space")
        if add_prefix is not None:
            writer.add_add_space_prefix(add_prefix)
    return tokens


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _sentencepiece(writer: gguf.GGUFWriter, folder: Path, config: ModelConfig) -> int:
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(folder / "tokenizer.model"))
    n_vocab = config.n_vocab or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [gguf.TokenType.UNUSED] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i] = sp.IdToPiece(i).encode("utf-8")
        scores[i] = sp.GetScore(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else gguf.TokenType.CONTROL
                    if sp.IsControl(i) else gguf.TokenType.UNUSED if sp.IsUnused(i)
                    else gguf.TokenType.BYTE if sp.IsByte(i) else gguf.TokenType.NORMAL)
    added = folder / "added_tokens.json"
    if added.is_file():
        for text, i in json.loads(added.read_text(encoding="utf-8")).items():
            if i < n_vocab:
                tokens[i], scores[i], types[i] = text.encode(), -1000.0, gguf.TokenType.USER_DEFINED
    for key, item in _tokenizer_config(folder).get("added_tokens_decoder", {}).items():
        i = int(key)
        if i < n_vocab:
            tokens[i] = item["content"].encode("utf-8")
            types[i] = gguf.TokenType.CONTROL if item.get("special") else gguf.TokenType.USER_DEFINED
            if types[i] == gguf.TokenType.USER_DEFINED:
                scores[i] = -1000.0
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)
    return len(tokens)


def _bpe(writer: gguf.GGUFWriter, folder: Path, config: ModelConfig) -> int:
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise MoeswapError(f"{folder}/tokenizer.json: tokenizer type {model.get('type')!r} is not "
                           "supported by convert (supported: BPE, or a SentencePiece tokenizer.model)")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for text, token in added.items():
        vocab[text] = token["id"]
    n_vocab = max(config.n_vocab, max(vocab.values()) + 1)
    by_id = {i: text for text, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif text in added:
            tokens.append(text)
            types.append(gguf.TokenType.CONTROL if added[text].get("special")
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_bpe_pre_tokenizer(spec, config))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)
    return len(tokens)
