import json

from megatron.training.tokenizer import ByteLevelTokenizer, GPT2BPETokenizer, NullTokenizer


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
