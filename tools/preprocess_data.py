"""Turn a text or JSONL file into a Megatron indexed dataset (``PREFIX_text_document.bin/.idx``).

    python tools/preprocess_data.py --input corpus.txt --output-prefix data/corpus \
        --tokenizer-type ByteLevelTokenizer
    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix data/docs \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt

A ``.txt`` input holds one document per blank-line-separated paragraph (``--split-on-lines``:
one per line); a ``.jsonl`` or ``.json`` input holds one JSON object per line (Megatron-LM's
preprocess_data reads its ``--input my-corpus.json`` so). Each document ends with the
tokenizer's end-of-document token (``--append-eod``, on by default), as Megatron-LM does.
Train with ``--data-path PREFIX_text_document`` and the same ``--tokenizer-type``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy
import torch


PARTIAL_SUFFIX = ".partial"
JSON_LINES_SUFFIXES = (".jsonl", ".json")


class InputError(ValueError):
    pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:  # it divides the document count
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--input", required=True,
                        help="a .txt file, or a .jsonl/.json file of JSON lines")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                        choices=("ByteLevelTokenizer", "GPT2BPETokenizer"))
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--split-on-lines", action="store_true",
                        help="plain text: one document per line instead of per paragraph")
    parser.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    parser.add_argument("--log-interval", type=_positive_int, default=10000,
                        help="documents per progress line")
    return parser


def text_documents(path: Path, split_on_lines: bool) -> Iterator[str]:
    """Read as it goes (a corpus may be larger than memory); a blank line ends a paragraph.
    Line ends are universal newlines, as ``read_text`` takes them: \\n, \\r\\n and \\r, and
    nothing else (a form feed or U+2028 inside a line does not split it)."""
    paragraph: list[str] = []
    with path.open("rb") as handle:  # decoded line by line, to name the line that is not UTF-8
        for number, raw in enumerate(handle, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # never train on replacement characters
                raise InputError(f"{path}:{number} is not UTF-8 text") from None
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            if not lines[-1]:  # the line's own end
                lines.pop()
            for line in lines:
                if split_on_lines:
                    if line.strip():
                        yield line.strip()
                elif line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "\n".join(paragraph).strip()
                    paragraph = []
    if paragraph:
        yield "\n".join(paragraph).strip()


def jsonl_documents(path: Path, keys: list[str]) -> Iterator[tuple[str, str]]:
    with path.open("rb") as handle:  # decoded line by line, to name the line that is not UTF-8
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{path}:{number} is not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested too deep to decode
                raise InputError(f"{path}:{number} is not valid JSON") from None
            for key in keys:
                if not isinstance(record, dict) or not isinstance(record.get(key), str):
                    raise InputError(f"{path}:{number} has no string field {key!r} "
                                     f"(choose fields with --json-keys)")
                try:
                    record[key].encode("utf-8")
                except UnicodeEncodeError:  # valid JSON ("\\ud800"), but no Unicode text
                    raise InputError(f"{path}:{number} field {key!r} holds a lone surrogate "
                                     f"escape, which is no Unicode text") from None
                yield key, record[key]


def _dtype_for(vocab_size: int):
    return numpy.uint16 if vocab_size < 65500 else numpy.int32


def _make_tokenizer(args):
    from megatron.training.tokenizer import TokenizerFileError, build_tokenizer

    if args.tokenizer_type == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if not path or not Path(path).is_file():
                raise InputError(f"GPT2BPETokenizer needs {flag} pointing to an existing file")
    try:
        return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                               merge_file=args.merge_file)
    except TokenizerFileError as error:  # a file that is there but not GPT-2's
        raise InputError(str(error)) from None


def preprocess(args: argparse.Namespace) -> dict[str, str]:
    """Write one dataset per JSON key (or one for text); returns key -> output prefix."""
    source = Path(args.input)
    if not source.is_file():
        raise InputError(f"--input {source} does not exist")
    tokenizer = _make_tokenizer(args)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # slow import

    if source.suffix.lower() in JSON_LINES_SUFFIXES:
        documents = jsonl_documents(source, args.json_keys)
        keys = args.json_keys
    else:
        documents = (("text", doc) for doc in text_documents(source, args.split_on_lines))
        keys = ["text"]
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in keys}
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    # Written under temporary names and renamed once all are complete: a run that fails
    # half-way must not truncate an earlier dataset's .bin beside its old .idx.
    partial = {path: path + PARTIAL_SUFFIX
               for prefix in prefixes.values() for path in (prefix + ".bin", prefix + ".idx")}
    builders = {}
    try:
        for key, prefix in prefixes.items():
            builders[key] = IndexedDatasetBuilder(partial[prefix + ".bin"],
                                                  dtype=_dtype_for(tokenizer.vocab_size))
        _fill(builders, documents, tokenizer, args)
        for key, builder in builders.items():
            builder.finalize(partial[prefixes[key] + ".idx"])
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for temporary in partial.values():
            Path(temporary).unlink(missing_ok=True)
        raise
    for path, temporary in partial.items():
        os.replace(temporary, path)
    return prefixes


def _fill(builders, documents, tokenizer, args) -> None:
    """Every record adds a document to each key's dataset, an empty one for an empty field, so
    that document i of one key is the same record's as of another; the end-of-document token
    ends a document that holds text. Both as Megatron-LM's preprocess_data does."""
    start, count, tokens = time.perf_counter(), 0, 0
    for key, text in documents:
        ids = tokenizer.tokenize(text)
        if ids and args.append_eod:
            ids.append(tokenizer.eod)
        # An empty one has no sequence (Megatron-LM's sentence_lens=[]): a sequence of 0
        # tokens in every document of a split part hung megatron-core's epoch count.
        builders[key].add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)] if ids else [])
        count += 1
        tokens += len(ids)
        if count % args.log_interval == 0:
            rate = tokens / (time.perf_counter() - start) / 1e6
            print(f"processed {count} documents, {tokens} tokens ({rate:.2f} M tokens/s)",
                  file=sys.stderr, flush=True)
    if tokens == 0:
        raise InputError(f"{args.input} holds no text")
    print(f"done: {count} documents, {tokens} tokens in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prefixes = preprocess(args)
    except (InputError, OSError) as problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    for prefix in prefixes.values():
        print(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
