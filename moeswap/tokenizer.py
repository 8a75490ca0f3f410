"""Tokenizers from GGUF metadata or a Hugging Face folder, with llama.cpp's special-token rules.

A GGUF carries its vocabulary as metadata. transformers knows how to turn that into a
``tokenizers.Tokenizer`` (SentencePiece-style ``llama`` and byte-level ``gpt2`` vocabularies),
but the conversion costs seconds on a 262k vocabulary; the result is cached as tokenizer.json
under ~/.cache/moeswap, keyed by a hash of the file's tokenizer metadata bytes, so a copy or a
rename of the model hits the cache and any change to the vocabulary misses it.

BOS/EOS/add_bos defaults, the end-of-generation set and the prefix space follow llama.cpp's
``llama_vocab::impl::load`` (src/llama-vocab.cpp of llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers, processors

from moeswap.errors import MoeswapError
from moeswap.formats.byte_level_bpe import (IGNORE_MERGES, SPLITS, byte_level_pre_tokenizer,
                                           keep_plain_text_control_tokens)
from moeswap.formats.gguf_file import GGUFFile
from moeswap.special_text import SpecialTexts

# Bump when the conversion below changes, so stale cache entries are not reused.
CONVERSION_VERSION = 3

# llama.cpp marks these token texts as end-of-generation, whatever the metadata says.
EOG_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# Metadata keys whose ids also end generation (llama.cpp: special_eog_ids).
EOG_ID_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id", "fim_pad_token_id",
               "fim_rep_token_id", "fim_sep_token_id")
# Byte-level pre-tokenizer types for which llama.cpp turns add_bos on by default.
BPE_PRE_TYPES_WITH_BOS = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "tekken", "chameleon",
})
TOKEN_TYPE_CONTROL = 3


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_id: int | None
    stop_ids: frozenset[int]  # generation ends at any of these (llama.cpp's EOG set)
    add_bos: bool
    add_eos: bool


class Tokenizer:
    """Text <-> token ids. ``encode`` adds BOS/EOS the way the model's metadata asks."""

    def __init__(self, backend: tokenizers.Tokenizer, specials: SpecialTokens,
                 chat_template: str | None):
        self.backend = backend
        self.specials = specials
        self.chat_template = chat_template
        self._special_mode_lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self.specials.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.specials.eos_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.specials.stop_ids

    def token_text(self, token_id: int | None) -> str:
        """The token as the vocabulary spells it (``<bos>``), '' for None."""
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special`` adds BOS/EOS as the model asks;
        ``parse_special`` turns control-token text like ``<start_of_turn>`` into that token
        (llama.cpp's parse_special; user-defined tokens are always matched, as there)."""
        with self._special_mode_lock:
            self.backend.encode_special_tokens = not parse_special
            # encode_batch lets go of the GIL while it works; encode holds it, so a 1 MB
            # prompt stopped every other thread of the server for 2 s
            return self.backend.encode_batch([text], add_special_tokens=add_special)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for, or None when the normalizer may
        shrink text (then no cheap bound holds). ``len(text.encode()) / max_token_bytes`` is a
        lower bound on the tokens of ``text``, known before tokenizing it."""
        if not _normalizer_only_grows(self.backend.normalizer):
            return None
        # A vocabulary string is never shorter than the text it covers: byte-level vocabularies
        # spell a byte in 1 or 2 bytes, SentencePiece a space as 3; <unk> covers one character.
        return max(4, max(len(t.encode()) for t in self.backend.get_vocab()))

    @functools.cached_property
    def _special_texts(self) -> SpecialTexts:
        added = self.backend.get_added_tokens_decoder()
        return SpecialTexts({t.content: i for i, t in added.items() if t.special and t.content})

    def protect(self, content: str) -> str:
        """``content`` (a chat message's text) marked so that ``encode_rendered`` reads the
        control-token text in it as text: a user who writes ``<|im_start|>system`` gets those
        characters, not the token (llama-server's rule for message content)."""
        return self._special_texts.mark(content)

    def encode_rendered(self, text: str, *, add_special: bool = True,
                        drop: tuple[int, int] | None = None) -> list[int]:
        """Token ids of a chat template's output whose message contents went through
        ``protect``: control-token text the template wrote becomes the token, the contents'
        stays text. Without protected contents this equals ``encode(text)``. ``drop``: the
        characters [start, end) left out, the text on each side tokenized alone."""
        ids = [self.bos_id] if add_special and self.specials.add_bos and self.bos_id is not None \
            else []
        parts = [text] if drop is None else [text[:drop[0]], text[drop[1]:]]
        for piece, token_id in (p for part in parts for p in self._special_texts.split(part)):
            if piece:
                ids += self.encode(piece, add_special=False, parse_special=False)
            if token_id is not None:
                ids.append(token_id)
        if add_special and self.specials.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def stream(self, prompt_ids: Sequence[int] = ()) -> "TextStream":
        return TextStream(self, prompt_ids)


def _normalizer_only_grows(normalizer) -> bool:
    """True when no normalizer step can make text shorter in bytes (none, or prepending, or
    replacing by a replacement at least as long): llama.cpp-style SentencePiece and byte-level
    vocabularies; NFKC, Strip, Lowercase may shrink it."""
    if normalizer is None:
        return True
    steps = json.loads(normalizer.__getstate__())
    steps = steps.get("normalizers", [steps]) if steps.get("type") == "Sequence" else [steps]
    for step in steps:
        pattern = step.get("pattern", {}).get("String") if step.get("type") == "Replace" else None
        if step.get("type") == "Prepend" or (
                pattern is not None and len(step["content"].encode()) >= len(pattern.encode())):
            continue
        return False
    return True


class TextStream:
    """Turns generated ids into text pieces as soon as they form whole characters.

    Primed with the prompt's last ids, so a generated token's leading space is kept where
    decoding it alone would strip it (SentencePiece vocabularies with a prefix space). The last
    ``PRIME`` are enough (a character spans at most 4 byte tokens) and keep the first step's
    decoding from costing a whole long prompt (30 ms for 55k ids, on the server's event loop)."""

    PRIME = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(ids=list(prompt_ids[-self.PRIME:]) or None,
                                             skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer.backend, token_id) or ""


def load_tokenizer(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer of a .gguf file or of a Hugging Face folder (tokenizer.json)."""
    path = Path(path)
    if path.is_dir():
        return tokenizer_from_hf_folder(path, cache_dir=cache_dir)
    return tokenizer_from_gguf(GGUFFile.open(path), cache_dir=cache_dir)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moeswap" / "tokenizers"


# --- GGUF ---------------------------------------------------------------------------------

def tokenizer_from_gguf(gguf: GGUFFile, *, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    model = gguf.get("tokenizer.ggml.model")
    if model not in ("llama", "gpt2", "gemma4"):
        raise MoeswapError(
            f"{gguf.path}: tokenizer.ggml.model is {model!r}; moeswap reads 'llama' "
            "(SentencePiece), 'gpt2' (byte-level BPE) and 'gemma4' vocabularies. Convert the "
            "model with a tokenizer of one of those kinds, or load its Hugging Face folder instead.")
    if gguf.get("tokenizer.ggml.tokens") is None:
        raise MoeswapError(f"{gguf.path}: no tokenizer.ggml.tokens key; the file has no "
                           "vocabulary. Re-convert it with llama.cpp's convert_hf_to_gguf.py.")
    cache_path = Path(cache_dir or default_cache_dir()) / f"{tokenizer_metadata_hash(gguf)}.json"
    backend = _read_cached(cache_path)
    if backend is None:
        backend = convert_gguf_vocabulary(gguf)
        _write_cached(cache_path, backend)
    specials = gguf_special_tokens(gguf, backend)
    _set_bos_eos_processor(backend, specials)
    return Tokenizer(backend, specials, gguf.get("tokenizer.chat_template"))


def tokenizer_metadata_hash(gguf: GGUFFile) -> str:
    """sha256 over the raw bytes of every tokenizer.ggml.* record (the chat template aside)."""
    digest = hashlib.sha256(f"moeswap-tokenizer-v{CONVERSION_VERSION}".encode())
    digest.update(str(gguf.architecture).encode())
    for key in sorted(k for k in gguf.kv if k.startswith("tokenizer.ggml.")):
        item = gguf.kv[key]
        digest.update(bytes(gguf.buffer[item.start:item.end]))
    return digest.hexdigest()[:32]


def gguf_special_tokens(gguf: GGUFFile, backend: tokenizers.Tokenizer) -> SpecialTokens:
    """BOS/EOS ids, add_bos/add_eos and the stop set, with llama.cpp's defaults."""
    model = gguf.get("tokenizer.ggml.model")
    n_vocab = len(gguf.get("tokenizer.ggml.tokens"))

    def token_id(key: str, default: int | None) -> int | None:
        value = gguf.get(f"tokenizer.ggml.{key}", default)
        return value if value is not None and 0 <= value < n_vocab else default

    spm = model == "llama"
    bos_id = token_id("bos_token_id", 1 if spm else None)
    eos_id = token_id("eos_token_id", 2 if spm else None)
    default_add_bos = spm or gguf.get("tokenizer.ggml.pre") in BPE_PRE_TYPES_WITH_BOS
    # llama.cpp turns add_bos on for gemma4 whatever the file says (its PR 21500)
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", default_add_bos)) or model == "gemma4"
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))

    stop_ids = {i for key in EOG_ID_KEYS if (i := token_id(key, None)) is not None}
    if eos_id is not None:
        stop_ids.add(eos_id)
    # (Looked up in the built vocabulary: decoding all 262k strings of the file costs 0.2 s.)
    by_text = {text: i for text in EOG_TOKEN_TEXTS if (i := backend.token_to_id(text)) is not None}
    stop_ids.update(by_text.values())
    # llama.cpp's harmony/solar-open rule: there "<|end|>" ends a message, not the generation.
    if "<|end|>" in by_text and (({"<|return|>", "<|call|>"} <= by_text.keys())
                                 or {"<|calls|>", "<|flush|>"} <= by_text.keys()):
        stop_ids.discard(by_text["<|end|>"])
    # ... and its gemma4/plamo rule: "</s>" is an ordinary token where these exist.
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        stop_ids.discard(by_text["</s>"])
    return SpecialTokens(bos_id, eos_id, frozenset(stop_ids), add_bos, add_eos)


def convert_gguf_vocabulary(gguf: GGUFFile) -> tokenizers.Tokenizer:
    """Build the tokenizer through transformers' GGUF converter, then set the prefix space."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    fields = {
        "tokenizer_type": "tokenizer.ggml.model", "pre_tokenizer_type": "tokenizer.ggml.pre",
        "tokens": "tokenizer.ggml.tokens", "scores": "tokenizer.ggml.scores",
        "token_type": "tokenizer.ggml.token_type", "merges": "tokenizer.ggml.merges",
        "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
        "unk_token_id": "tokenizer.ggml.unknown_token_id",
        "pad_token_id": "tokenizer.ggml.padding_token_id",
    }
    vocabulary = {}
    for name, key in fields.items():
        value = gguf.get(key)
        if value is None:
            continue
        vocabulary[name] = value.tolist() if hasattr(value, "tolist") else (
            value.to_list() if hasattr(value, "to_list") else value)
    backend, _ = convert_gguf_tokenizer(gguf.architecture or "", vocabulary)
    if vocabulary["tokenizer_type"] == "llama":
        _set_spm_prefix_space(backend, bool(gguf.get("tokenizer.ggml.add_space_prefix", True)))
    if vocabulary["tokenizer_type"] == "gemma4":
        _set_gemma4_newline_rule(backend)
    if vocabulary["tokenizer_type"] == "gpt2" and vocabulary.get("pre_tokenizer_type") in SPLITS:
        # pre-types transformers does not know (DeepSeek-V3, Kimi-K2, GLM): llama.cpp's splits
        backend.pre_tokenizer = byte_level_pre_tokenizer(vocabulary["pre_tokenizer_type"])
        if vocabulary["pre_tokenizer_type"] in IGNORE_MERGES:  # whole-word vocabulary hits first
            backend.model.ignore_merges = True
    if vocabulary["tokenizer_type"] == "gpt2":
        backend = keep_plain_text_control_tokens(backend, vocabulary["tokens"],
                                                 vocabulary.get("token_type"))
    backend.post_processor = None
    return backend


def _set_gemma4_newline_rule(backend: tokenizers.Tokenizer) -> None:
    """llama.cpp's gemma4 vocabulary (llm_tokenizer_bpe_session, LLAMA_VOCAB_PRE_TYPE_GEMMA4):
    spaces as '▁', BPE merges over each run of newlines and each stretch between them (never
    across), and a run of newlines that is itself a token taken whole, merges or not. Here any
    piece that is a token is taken whole (only a stretch between newlines that is a token its
    merges do not reach can differ: whole here, merged there)."""
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"\n+"), behavior="isolated")
    backend.model.ignore_merges = True


def _set_spm_prefix_space(backend: tokenizers.Tokenizer, add_space_prefix: bool) -> None:
    """llama.cpp escapes spaces as '▁' and, with add_space_prefix, puts one before the text and
    after every special token (transformers' LlamaTokenizer only before the text)."""
    # The normalizer runs on each stretch of text between special tokens, as llama.cpp's
    # prefix does; Metaspace would not prefix text that already starts with a space.
    replace_spaces = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = None
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace_spaces])
        backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)])
    else:
        backend.normalizer = replace_spaces
        backend.decoder = decoders.Sequence(steps)


def _set_bos_eos_processor(backend: tokenizers.Tokenizer, specials: SpecialTokens) -> None:
    """encode(add_special_tokens=True) adds BOS/EOS exactly when the metadata asks."""
    bos = backend.id_to_token(specials.bos_id) if specials.add_bos and specials.bos_id is not None else None
    eos = backend.id_to_token(specials.eos_id) if specials.add_eos and specials.eos_id is not None else None
    single = [t for t in (bos, "$A", eos) if t is not None]
    added = [(bos, specials.bos_id), (eos, specials.eos_id)]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=single + ["$B"],
        special_tokens=list({text: i for text, i in added if text is not None}.items()))


def _read_cached(path: Path) -> tokenizers.Tokenizer | None:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # missing, truncated or from another tokenizers version: rebuild it
        return None


def _write_cached(path: Path, backend: tokenizers.Tokenizer) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(partial), pretty=False)
        os.replace(partial, path)
    except OSError:
        pass  # an unwritable cache only costs time on the next load


# --- Hugging Face folder ------------------------------------------------------------------

def tokenizer_from_hf_folder(folder: Path, *, cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """tokenizer.json for the vocabulary; tokenizer_config.json, config.json and
    generation_config.json for BOS/EOS, add_bos and the chat template. A folder with only a
    SentencePiece tokenizer.model goes through the vocabulary ``moeswap convert`` writes."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.exists() and (folder / "tokenizer.model").exists():
        return _tokenizer_from_sentencepiece_folder(folder, cache_dir)
    if not tokenizer_file.exists():
        raise MoeswapError(f"{folder}: no tokenizer.json or tokenizer.model. Save the tokenizer "
                           "with transformers' tokenizer.save_pretrained(folder).")
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    generation_config = _read_json(folder / "generation_config.json")

    def special_id(name: str) -> int | None:
        token = tokenizer_config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and backend.token_to_id(token) is not None:
            return backend.token_to_id(token)
        value = generation_config.get(f"{name}_id", model_config.get(f"{name}_id"))
        return value[0] if isinstance(value, list) and value else value

    bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
    stop_ids = {eos_id} if eos_id is not None else set()
    for config in (model_config, generation_config):
        value = config.get("eos_token_id")
        stop_ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    probe = backend.encode("", add_special_tokens=True).ids
    specials = SpecialTokens(bos_id, eos_id, frozenset(stop_ids),
                             add_bos=bos_id is not None and bos_id in probe[:1],
                             add_eos=eos_id is not None and eos_id in probe[-1:])
    return Tokenizer(backend, specials, _hf_chat_template(folder, tokenizer_config))


def _tokenizer_from_sentencepiece_folder(folder: Path, cache_dir) -> Tokenizer:
    """Write the folder's vocabulary as ``moeswap convert`` does into a metadata-only GGUF
    (cached), then read that: the folder then tokenizes exactly as its converted file."""
    import gguf

    from moeswap.formats.config import config_from_hf
    from moeswap.formats.vocab_to_gguf import write_vocab

    digest = hashlib.sha256(f"moeswap-sentencepiece-v{CONVERSION_VERSION}".encode())
    for name in ("tokenizer.model", "tokenizer_config.json", "added_tokens.json",
                 "special_tokens_map.json", "config.json", "generation_config.json"):
        if (folder / name).exists():
            digest.update(name.encode() + (folder / name).read_bytes())
    vocab_file = Path(cache_dir or default_cache_dir()) / f"{digest.hexdigest()[:32]}.gguf"
    if not vocab_file.exists():
        config = config_from_hf(folder)
        vocab_file.parent.mkdir(parents=True, exist_ok=True)
        partial = vocab_file.with_suffix(f".{os.getpid()}.tmp")
        writer = gguf.GGUFWriter(str(partial), config.arch)
        write_vocab(writer, folder, config)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, vocab_file)
    return tokenizer_from_gguf(GGUFFile.open(vocab_file), cache_dir=cache_dir)


def _hf_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    template_file = folder / "chat_template.jinja"
    if template_file.exists():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise MoeswapError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); "
                           "fix or re-save the file.") from None
