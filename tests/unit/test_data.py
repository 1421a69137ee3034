"""Real training data (``--data-path``): a corpus megatron-core cannot use is one DataError at
start-up, never a hang or an error on the first rank that reads its bad bytes."""

import argparse
import re
from pathlib import Path

import numpy
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.training.data import DataError, build_datasets, dataset_sizes
from megatron.training.tokenizer import ByteLevelTokenizer, NullTokenizer


def write_corpus(prefix: Path, documents: int, tokens: int = 40) -> str:
    """``documents`` documents of ``tokens`` byte tokens each, ending with end-of-document."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16)
    for document in range(documents):
        ids = [(document + i) % 256 for i in range(tokens - 1)] + [ByteLevelTokenizer.eod]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def data_args(prefix: str, tmp_path: Path, **overrides) -> argparse.Namespace:
    args = dict(seed=1, seq_length=16, mock_data=False, data_path=[prefix], split="98,2,0",
                data_cache_path=str(tmp_path / "cache"), train_samples=64, global_batch_size=8,
                eval_interval=4, eval_iters=1)
    return argparse.Namespace(**{**args, **overrides})


def test_a_whole_corpus_builds(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", 100)
    train, valid, _ = build_datasets(data_args(prefix, tmp_path), ByteLevelTokenizer())
    assert len(train) >= 64 and len(valid) >= 1
    assert int(train[63]["tokens"].max()) < ByteLevelTokenizer.vocab_size


def test_a_truncated_bin_is_a_data_error_at_start_up(tmp_path):
    """megatron-core maps the .bin without checking its size: the dataset built, and the first
    read past the cut raised numpy's "buffer is smaller than requested size" mid-training."""
    prefix = write_corpus(tmp_path / "corpus", 100)
    data = Path(prefix + ".bin")
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:size // 2])
    said = f"the training data {data} is truncated: {size // 2} bytes, where its index needs {size}"
    with pytest.raises(DataError, match=f"^{re.escape(said)}$"):
        build_datasets(data_args(prefix, tmp_path), ByteLevelTokenizer())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sequences, split, eval_iters, part", [
    (300, "969,30,1", 1, "test"),  # the default --split: 0.999 x 300 rounds to 300
    (30, "99,1,0", 0, "validation"),  # built even without evaluation
])
def test_a_split_part_without_a_sequence_is_a_data_error_not_a_hang(tmp_path, sequences, split,
                                                                    eval_iters, part):
    """megatron-core adds epochs until a part holds the samples asked for: with no sequence
    it added 0 tokens an epoch, forever, and start-up hung. The line counts documents and says
    that --split divides them: "none of the 1 sequences" of a corpus of 600,000 tokens in one
    paragraph read as a count of --seq-length samples."""
    prefix = write_corpus(tmp_path / "corpus", sequences)
    said = (f"--split {split} gives the {part} part none of the {sequences} non-empty documents of "
            f"{prefix} (it divides whole documents, not --seq-length samples; "
            f"tools/preprocess_data.py makes one per paragraph of a text file, or per line with "
            f"--split-on-lines): give a larger corpus, or a --split that gives that part more "
            f"or leaves it out (0)")
    with pytest.raises(DataError, match=f"^{re.escape(said)}$"):
        build_datasets(data_args(prefix, tmp_path, split=split, eval_iters=eval_iters),
                       ByteLevelTokenizer())



@pytest.mark.parametrize("eval_iters, built", [(0, [True, False, False]), (2, [True, True, False])])
def test_mock_data_builds_only_the_splits_training_reads_and_train_draws_the_same_samples(
        tmp_path, eval_iters, built):
    args = data_args("", tmp_path, mock_data=True, data_path=None, split="969,30,1",
                     data_cache_path=None, eval_iters=eval_iters)
    tokenizer = NullTokenizer(100)
    datasets = build_datasets(args, tokenizer)
    assert [dataset is not None for dataset in datasets] == built
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=None,
                              split=args.split, tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False)
    every_split = BlendedMegatronDatasetBuilder(MockGPTDataset, dataset_sizes(args),
                                                lambda: True, config).build()
    assert all(dataset is not None for dataset in every_split)
    for index in (0, 1, args.train_samples - 1):
        assert torch.equal(datasets[0][index]["tokens"], every_split[0][index]["tokens"])


def test_a_corpus_made_again_at_the_same_prefix_is_not_read_through_the_old_ones_indices(
        tmp_path):
    """megatron-core names its index cache after the corpus's path and the config alone: a
    smaller corpus made again at the same prefix was read through the old one's indices, 1215
    samples where 96 were built, and a read past its documents raised mid-training."""
    prefix = write_corpus(tmp_path / "corpus", 400)
    args = data_args(prefix, tmp_path, split="100,0,0", eval_iters=0, data_cache_path=None)
    before = len(build_datasets(args, ByteLevelTokenizer())[0])
    write_corpus(tmp_path / "corpus", 40)
    train = build_datasets(args, ByteLevelTokenizer())[0]
    fresh = build_datasets(data_args(prefix, tmp_path, split="100,0,0", eval_iters=0,
                                     data_cache_path=str(tmp_path / "fresh")),
                           ByteLevelTokenizer())[0]
    assert len(train) == len(fresh) < before
    for index in range(len(train)):
        assert torch.equal(train[index]["tokens"], fresh[index]["tokens"])


def test_training_that_reads_past_its_split_says_so_once(monkeypatch, capsys):
    """A --train-iters resumed at a smaller global batch than the checkpoint's read past the
    samples its split was built with, and the modulo read the split's first ones again,
    silently (Megatron-LM's sampler refuses)."""
    from megatron.core import parallel_state

    from megatron.training.data import BatchPrefetcher

    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda *a, **k: 1)
    dataset = [{"tokens": torch.tensor([i])} for i in range(10)]
    batches = BatchPrefetcher(dataset, micro_batch_size=2, num_micro_batches=2,
                              global_batch_size=4, pin_memory=False)
    try:
        list(batches.iteration(4))
        assert capsys.readouterr().out == ""
        read = [int(t) for batch in batches.iteration(8) for t in batch["tokens"]]
        list(batches.iteration(12))
    finally:
        batches.close()
    assert read == [8, 9, 0, 1]
    said = capsys.readouterr().out
    assert said.count("warning: training reads samples 8 to 11, past the 10 its split") == 1
    assert said.count("warning") == 1
