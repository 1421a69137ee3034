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
