import json
import subprocess
import sys

import pytest

from helpers.trainer import PRETRAIN, SMALL_GPT, trainer_env
from megatron.training.tokenizer import (ByteLevelTokenizer, GPT2BPETokenizer, NullTokenizer,
                                         TokenizerFileError)


def test_byte_level_round_trip():
    tokenizer = ByteLevelTokenizer()
    text = "héllo, wörld"
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.eod == 256 and tokenizer.vocab_size == 257


def test_null_tokenizer_matches_megatron():
    tokenizer = NullTokenizer(100)
    assert tokenizer.eod == 100 and tokenizer.vocab_size == 101
    assert tokenizer.tokenize("1 2 3") == [1, 2, 3]


def test_gpt2_bpe_applies_merges_in_rank_order(tmp_path):
    vocab = {"l": 0, "o": 1, "w": 2, "lo": 3, "low": 4, "Ġ": 5, "Ġlow": 6, "Ġl": 7,
             "<|endoftext|>": 8}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nl o\nlo w\nĠ low\nĠ l\n")
    tokenizer = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tokenizer.tokenize("low low") == [4, 6]
    assert tokenizer.detokenize([4, 6]) == "low low"
    assert tokenizer.eod == 8


def test_gpt2_bpe_keeps_the_merges_of_hash_signs(tmp_path):
    """GPT-2's merges.txt merges "# #" into "##" (and "## #", "## ##"): only its first line,
    "#version: 0.2", is no merge. Skipping every line that starts with "#" split "##" in two."""
    vocab = {"#": 0, "##": 1, "###": 2, "####": 3, "<|endoftext|>": 4}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n# #\n## #\n## ##\n")
    tokenizer = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tokenizer.tokenize("##") == [1]
    assert tokenizer.tokenize("####") == [3]
    assert tokenizer.tokenize("###") == [2]


@pytest.mark.parametrize("vocab, said", [
    ("", "is not JSON"),
    ('{"a": 0', "is not JSON"),
    ('["a", "b"]', "is not a JSON object of token ids"),
    ('{"a": "0"}', "is not a JSON object of token ids"),
    ("{}", "is not a JSON object of token ids"),
])
def test_a_vocab_file_that_is_not_gpt2s_is_one_clear_error(tmp_path, vocab, said):
    (tmp_path / "vocab.json").write_text(vocab)
    (tmp_path / "merges.txt").write_text("#version: 0.2\nl o\n")
    with pytest.raises(TokenizerFileError, match=f"--vocab-file {tmp_path / 'vocab.json'} {said}"):
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))


def test_a_merges_file_that_is_not_text_is_one_clear_error(tmp_path):
    (tmp_path / "vocab.json").write_text('{"l": 0}')
    (tmp_path / "merges.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TokenizerFileError, match=f"cannot read --merge-file {tmp_path / 'merges.txt'}: "
                                                 f"'utf-8' codec can't decode"):
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))


def test_the_trainer_refuses_a_bad_vocab_file_in_one_line(tmp_path):
    """The arguments only check that the files exist; an empty vocab.json reached json's
    JSONDecodeError as a traceback, with torch elastic's error file, on every rank."""
    (tmp_path / "vocab.json").write_text("")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    result = subprocess.run(
        [sys.executable, PRETRAIN, *SMALL_GPT, "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"),
         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"],
        capture_output=True, text=True, env=trainer_env(), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert said == [f"error: --vocab-file {tmp_path / 'vocab.json'} is not JSON (Expecting value: "
                    f"line 1 column 1 (char 0)): give GPT-2's vocab.json"], result.stderr[-3000:]
