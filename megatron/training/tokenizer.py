"""Tokenizers named as in Megatron-LM, plus a byte-level one that needs no files.

Each exposes what ``megatron.core.datasets`` and the trainer use: ``vocab_size``, ``eod``,
``pad`` (None: the datasets then pick a safe pad id), ``tokenize`` and ``detokenize``.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict

# GPT-2's pre-tokenisation: contractions, letter runs, digit runs, other symbols, spaces.
_GPT2_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


class _Tokenizer:
    pad = None
    special_tokens_dict: dict = {}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Part of the dataset cache key, as megatron-core expects."""
        return OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size)


class NullTokenizer(_Tokenizer):
    """Token ids are the text's integers; ``vocab_size`` is end-of-document, as in Megatron-LM."""

    def __init__(self, vocab_size: int):
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(token) for token in ids)


class ByteLevelTokenizer(_Tokenizer):
    """UTF-8 bytes are ids 0-255; 256 is end-of-document."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(token for token in ids if token < 256).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


class TokenizerFileError(ValueError):
    """A --vocab-file or --merge-file that is not GPT-2's: bad arguments, alike on every rank."""


def _read_text(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise TokenizerFileError(f"cannot read {flag} {path}: {error}") from None


def _read_vocab(path: str) -> dict[str, int]:
    """GPT-2's vocab.json: a JSON object of token -> id."""
    text = _read_text("--vocab-file", path)
    try:
        vocab = json.loads(text)
    except ValueError as error:
        raise TokenizerFileError(f"--vocab-file {path} is not JSON ({error}): give GPT-2's "
                                 f"vocab.json") from None
    if not (vocab and isinstance(vocab, dict)
            and all(type(token_id) is int for token_id in vocab.values())):
        raise TokenizerFileError(f"--vocab-file {path} is not a JSON object of token ids: give "
                                 f"GPT-2's vocab.json")
    return vocab


class GPT2BPETokenizer(_Tokenizer):
    """GPT-2 byte-level BPE from a ``vocab.json`` and a ``merges.txt``."""

    def __init__(self, vocab_file: str, merge_file: str):
        import regex  # only this tokenizer needs Unicode classes in its pattern

        self.encoder = _read_vocab(vocab_file)
        self.decoder = {token_id: token for token, token_id in self.encoder.items()}
        lines = _read_text("--merge-file", merge_file).splitlines()
        if lines and lines[0].startswith("#version"):  # GPT-2's header; "# #" is a merge
            lines = lines[1:]
        merges = [tuple(pair) for pair in map(str.split, lines) if len(pair) == 2]
        self.merge_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        self.pattern = regex.compile(_GPT2_PATTERN)
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder.get("<|endoftext|>", self.vocab_size - 1)
        self._cache: dict[str, list[str]] = {}

    def _bpe(self, word: str) -> list[str]:
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = {(parts[i], parts[i + 1]) for i in range(len(parts) - 1)}
            best = min(pairs, key=lambda pair: self.merge_ranks.get(pair, float("inf")))
            if best not in self.merge_ranks:
                break
            parts = self._merge(parts, best)
        self._cache[word] = parts
        return parts

    @staticmethod
    def _merge(parts: list[str], pair: tuple[str, str]) -> list[str]:
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        return merged

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_encoder[byte] for byte in piece.encode("utf-8"))
            ids.extend(self.encoder[token] for token in self._bpe(word) if token in self.encoder)
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder.get(token_id, "") for token_id in ids)
        return bytearray(self.byte_decoder[char] for char in text).decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type: str, vocab_size: int | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None):
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}")
