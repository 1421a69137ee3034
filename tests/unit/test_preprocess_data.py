"""tools/preprocess_data.py: bad input ends in one line, and never in a half-written dataset."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"


@pytest.fixture(scope="module")
def preprocess_data():
    spec = importlib.util.spec_from_file_location("preprocess_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(module, source, prefix, *extra):
    return module.main(["--input", str(source), "--output-prefix", str(prefix), *extra])


def test_a_jsonl_file_that_is_not_utf8_is_one_line(preprocess_data, tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    source.write_bytes(b'{"text": "hello"}\n{"text": "caf\xe9"}\n')
    assert run(preprocess_data, source, tmp_path / "out" / "docs") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "UTF-8" in error and "\n" not in error


@pytest.mark.parametrize("bad", ['{"text": "new"}\n{"body": "no text field"}\n', ""])
def test_a_failed_run_leaves_an_earlier_dataset_whole_and_writes_nothing(
        preprocess_data, tmp_path, bad):
    prefix = tmp_path / "out" / "docs"
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n{"text": "world"}\n')
    assert run(preprocess_data, good, prefix) == 0
    written = {path.name: path.read_bytes() for path in prefix.parent.iterdir()}
    source = tmp_path / "bad.jsonl"
    source.write_text(bad)
    assert run(preprocess_data, source, prefix) == 2
    assert {path.name: path.read_bytes() for path in prefix.parent.iterdir()} == written
    assert run(preprocess_data, source, tmp_path / "other" / "docs") == 2
    assert not list((tmp_path / "other").iterdir())


@pytest.mark.parametrize("interval", ["0", "-1"])
def test_a_log_interval_below_one_is_a_usage_error(preprocess_data, tmp_path, capsys, interval):
    source = tmp_path / "docs.txt"
    source.write_text("hello\n")
    with pytest.raises(SystemExit) as exit_:
        run(preprocess_data, source, tmp_path / "docs", "--log-interval", interval)
    assert exit_.value.code == 2 and "--log-interval" in capsys.readouterr().err


def test_a_vocab_file_that_is_not_gpt2s_is_one_line(preprocess_data, tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "hello"}\n')
    (tmp_path / "vocab.json").write_text("not json")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    assert run(preprocess_data, source, tmp_path / "docs", "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", str(tmp_path / "vocab.json"),
               "--merge-file", str(tmp_path / "merges.txt")) == 2
    assert "--vocab-file" in capsys.readouterr().err


def test_json_nested_too_deep_to_decode_is_one_line(preprocess_data, tmp_path, capsys):
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "hello"}\n' + "[" * 200_000 + "\n")
    assert run(preprocess_data, source, tmp_path / "docs") == 2
    assert ":2 is not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["corpus.json", "corpus.JSONL"])
def test_a_json_file_as_megatron_lms_docs_name_it_holds_json_lines(preprocess_data, tmp_path, name):
    """Megatron-LM's README runs ``--input my-corpus.json``: that file was read as plain text,
    and the dataset held the JSON syntax, braces and keys, as one document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    source = tmp_path / name
    source.write_text('{"text": "hello"}\n{"text": "world"}\n')
    assert run(preprocess_data, source, tmp_path / "docs") == 0
    dataset = IndexedDataset(str(tmp_path / "docs_text_document"))
    assert [bytes(dataset[i][:-1].tolist()) for i in range(len(dataset))] == [b"hello", b"world"]


def test_a_text_file_that_is_not_utf8_is_one_line_not_replacement_characters(
        preprocess_data, tmp_path, capsys):
    """A Latin-1 corpus was decoded with errors="replace": the dataset silently held U+FFFD
    where its accented letters were."""
    source = tmp_path / "corpus.txt"
    source.write_bytes("first paragraph\n\ncafé au lait\n".encode("latin-1"))
    assert run(preprocess_data, source, tmp_path / "out" / "docs") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and ":3 is not UTF-8" in error and "\n" not in error
    assert not (tmp_path / "out" / "docs_text_document.bin").exists()


def _token_ids(prefix) -> list[list[int]]:
    """Each document's tokens, by the index's document boundaries (an empty document has no
    sequence)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [[token for sequence in range(bounds[d], bounds[d + 1])
             for token in dataset[sequence].tolist()] for d in range(len(bounds) - 1)]


def _documents(prefix) -> list[bytes]:
    return [bytes(ids) for ids in _token_ids(prefix)]


def test_a_line_is_one_document_whatever_it_holds(preprocess_data, tmp_path):
    """str.splitlines() also split at a form feed, \\x1c-\\x1e, U+0085, U+2028 and U+2029:
    a line holding one was several documents. Line ends are \\n, \\r\\n and \\r alone."""
    source = tmp_path / "corpus.txt"
    source.write_bytes("one\x0cpage\r\ntwo\u2028three\rfour".encode())
    assert run(preprocess_data, source, tmp_path / "lines", "--split-on-lines",
               "--no-append-eod") == 0
    assert _documents(tmp_path / "lines_text_document") == [
        "one\x0cpage".encode(), "two\u2028three".encode(), b"four"]
    source.write_bytes(b"first\nparagraph\n  \nsecond\n\n\nthird\n")
    assert run(preprocess_data, source, tmp_path / "paragraphs", "--no-append-eod") == 0
    assert _documents(tmp_path / "paragraphs_text_document") == [
        b"first\nparagraph", b"second", b"third"]


def test_a_lone_surrogate_is_one_line_naming_it(preprocess_data, tmp_path, capsys):
    """Valid JSON ("\\ud800", truncated UTF-16 from the web) that is no Unicode text: it
    ended in a UnicodeEncodeError's traceback."""
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n')
    assert run(preprocess_data, source, tmp_path / "out" / "docs") == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and ":2 field 'text'" in error and "\n" not in error


@pytest.mark.parametrize("eod", [True, False])
def test_each_keys_documents_stay_the_records(preprocess_data, tmp_path, eod):
    """An empty field was left out of its key's dataset alone (with --no-append-eod): document
    i of "title" was no longer record i's. Megatron-LM adds an empty document, and the
    end-of-document token only after text."""
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "a", "title": "A"}\n{"text": "b", "title": ""}\n'
                      '{"text": "c", "title": "C"}\n')
    extra = [] if eod else ["--no-append-eod"]
    assert run(preprocess_data, source, tmp_path / "d", "--json-keys", "text", "title",
               *extra) == 0
    end = [256] if eod else []  # the byte tokenizer's end of document
    assert _token_ids(tmp_path / "d_text_document") == [[97] + end, [98] + end, [99] + end]
    assert _token_ids(tmp_path / "d_title_document") == [[65] + end, [], [67] + end]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # no sequence of 0 tokens: one in every document of a split part hung megatron-core
    assert list(IndexedDataset(str(tmp_path / "d_title_document")).sequence_lengths) == \
        [1 + len(end), 1 + len(end)]
