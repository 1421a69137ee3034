"""Training data: megatron-core GPT datasets and a sampler that resumes at the exact sample.

Sample order is global and independent of the parallel layout. Iteration ``i`` consumes the
global batch ``[consumed, consumed + global_batch_size)``. That batch is cut into
``micro_batch_size x data_parallel_size`` slices, and data-parallel rank ``r`` takes rank ``r``'s
share of each slice, as Megatron-LM's ``MegatronPretrainingSampler`` does. A resume under
any DP therefore continues at sample ``consumed_samples``, with nothing repeated or skipped.
"""

from __future__ import annotations

import argparse
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch
import xxhash
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path
from megatron.core.datasets.utils import Split, get_blend_from_list
from torch.utils.data import default_collate

from .console import log_last_rank


def dataset_sizes(args: argparse.Namespace) -> list[int]:
    """Samples needed per split (train, valid, test), as Megatron-LM computes them."""
    train = args.train_samples
    iterations = -(-args.train_samples // args.global_batch_size)
    evaluations = iterations // args.eval_interval + 1 if args.eval_iters else 0
    valid = args.eval_iters * evaluations * args.global_batch_size
    test = args.eval_iters * args.global_batch_size
    return [max(train, 1), max(valid, 1), max(test, 1)]


def splits_read(split_matrix: list, eval_iters: int) -> list:
    """The split matrix with the splits training never reads set to None, which megatron-core
    does not build: valid unless it evaluates, and test always. Mock data has no index cache,
    so every rank of every start built all three shuffle indices (0.48 s of CPU a rank here,
    0.38 s of it shuffling). Only for mock data: ``split_matrix`` is part of a real corpus's
    cache key. Train keeps its range of the split, so it draws the same samples."""
    read = {Split.train.value} | ({Split.valid.value} if eval_iters else set())
    return [bounds if split in read else None for split, bounds in enumerate(split_matrix)]


class DataError(Exception):
    """The training data cannot be used: a missing, truncated or corrupt corpus, or one made
    with another tokenizer. No relaunch, on any GPU, reads other bytes."""


def build_datasets(args: argparse.Namespace, tokenizer):
    """Build (train, valid, test) on every rank; megatron-core lets rank 0 build caches first.
    A corpus whose index cannot be read is a DataError."""
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path if args.mock_data else _cache_folder(args),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The local attention builds its causal mask itself; one mask path for every layout.
        create_attention_mask=False,
    )
    if args.mock_data:
        config.split_matrix = splits_read(config.split_matrix, args.eval_iters)
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(dataset_cls, dataset_sizes(args), lambda: True, config)
    if args.mock_data:
        return builder.build()
    try:
        for prefix in config.blend[0]:
            _check_corpus(prefix, config)
        return builder.build()
    except (OSError, ValueError, AssertionError, IndexError, struct.error) as error:
        raise DataError(f"cannot read the training data {' '.join(args.data_path)}: "
                        f"{type(error).__name__}: {error}") from error


def _cache_folder(args: argparse.Namespace) -> str:
    """Where megatron-core keeps the corpus's index cache: ``--data-cache-path`` (else beside
    the first corpus, where megatron-core would), in a folder named for the digest of every
    corpus's ``.idx``. megatron-core names its cache files after the corpus's path and the
    config, never its contents: a corpus made again at the same prefix was read through the
    old one's indices (an IndexError mid-training on a smaller one, a silent subset of a
    larger one). The indices depend on the document lengths alone, which the ``.idx`` holds.
    Read by rank 0 alone and given to the others: a large corpus's index is gigabytes, read
    at every relaunch."""
    prefixes = get_blend_from_list(args.data_path)[0]
    distributed = torch.distributed.is_initialized()
    found = [_index_digest(prefixes) if not distributed or torch.distributed.get_rank() == 0
             else None]
    if distributed:
        torch.distributed.broadcast_object_list(found, src=0)
    if isinstance(found[0], DataError):
        raise found[0]
    base = args.data_cache_path or os.path.join(prefixes[0], "cache")
    return os.path.join(base, f"GPTDataset_indices-{found[0]}")


def _index_digest(prefixes: list[str]) -> str | DataError:
    """The digest of the corpora's ``.idx`` files, or the DataError of one that cannot be
    read (returned: every rank raises it)."""
    digest = xxhash.xxh3_64()
    try:
        for prefix in prefixes:
            with open(get_idx_path(prefix), "rb") as index:
                while chunk := index.read(1 << 22):
                    digest.update(chunk)
    except OSError as error:
        return DataError(f"cannot read the training data's index {error.filename}: "
                         f"{error.strerror}")
    return digest.hexdigest()


def _check_corpus(prefix: str, config: GPTDatasetConfig) -> None:
    """A DataError for a corpus that megatron-core would accept and then fail on later (on
    whichever rank first reads the bytes that are missing) or hang on."""
    corpus = GPTDataset.build_low_level_dataset(prefix, config)
    _check_complete(prefix, corpus.index)
    _check_split(prefix, GPTDataset.numel_low_level_dataset(corpus), config)


def _check_complete(prefix: str, index) -> None:
    """The .bin must hold every sequence its index points to: megatron-core maps it without
    looking at its size, and a read past its end is a numpy ValueError mid-training."""
    if not len(index):
        return
    # The index writer lays the sequences out in order: the last one ends the data.
    needed = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
    size = os.path.getsize(get_bin_path(prefix))
    if size < needed:
        raise DataError(f"the training data {get_bin_path(prefix)} is truncated: {size} bytes, "
                        f"where its index needs {needed}")


def _check_split(prefix: str, sequences: int, config: GPTDatasetConfig) -> None:
    """Each part of --split must get a sequence of the corpus. megatron-core adds epochs until
    a part holds the samples asked for, and one with no sequence adds 0 tokens an epoch:
    start-up hung, on a corpus of under 500 sequences with the default --split 969,30,1.
    The index's sequences are what tools/preprocess_data.py calls documents (those with
    text: an empty one has none), so the line says non-empty documents: a user reads
    "sequences" as --seq-length samples."""
    for name, bounds in zip(("train", "validation", "test"), config.split_matrix):
        # the builder's own rounding (_build_megatron_dataset_splits)
        if bounds is not None and round(bounds[0] * sequences) == round(bounds[1] * sequences):
            raise DataError(f"--split {config.split} gives the {name} part none of the "
                            f"{sequences} non-empty documents of {prefix} (it divides whole "
                            f"documents, "
                            f"not --seq-length samples; tools/preprocess_data.py makes one per "
                            f"paragraph of a text file, or per line with --split-on-lines): "
                            f"give a larger corpus, or a --split that gives that part more or "
                            f"leaves it out (0)")


def check_tokens(batch: dict[str, torch.Tensor], vocab_size: int) -> None:
    """A DataError when a batch holds a token id outside the tokenizer's vocabulary, which the
    embedding would otherwise meet as an index error on whichever rank reads it."""
    for key in ("tokens", "labels"):
        ids = batch.get(key)
        if ids is None or not ids.numel():
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise DataError(f"the training data holds token id {bad}, outside the tokenizer's "
                            f"vocabulary of {vocab_size}: the corpus is corrupt, or was made "
                            f"with another tokenizer")


def needs_data() -> bool:
    """Only the first pipeline stage (tokens) and the last (labels) read batches."""
    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()


def micro_batch_indices(consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                        num_micro_batches: int) -> Iterator[list[int]]:
    """Sample indices of each micro-batch that ``dp_rank`` trains on in one iteration."""
    stride = micro_batch_size * dp_size
    for micro in range(num_micro_batches):
        start = consumed + micro * stride + dp_rank * micro_batch_size
        yield list(range(start, start + micro_batch_size))


class MicroBatches:
    """Iterator over this rank's micro-batches for one iteration, read straight from ``dataset``.

    Index arithmetic wraps modulo the dataset size, so evaluation can cycle the validation split.
    """

    def __init__(self, dataset, consumed: int, micro_batch_size: int, num_micro_batches: int,
                 vocab_size: int | None = None):
        self.dataset = dataset
        self.vocab_size = vocab_size
        """Token ids are checked against it (real data); None: not checked (mock data)."""
        self.indices = micro_batch_indices(
            consumed, micro_batch_size, parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(), num_micro_batches)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        size = len(self.dataset)
        batch = default_collate([self.dataset[index % size] for index in next(self.indices)])
        if self.vocab_size is not None:
            check_tokens(batch, self.vocab_size)
        return batch


class BatchPrefetcher:
    """This iteration's micro-batches, with the next iteration's built on a background thread
    while this one trains, and pinned on CUDA so their copy to the GPU overlaps compute.

    The batches of an iteration depend only on its consumed-samples count, so the next one is
    known (``consumed + global_batch_size``); any other request (the first, after a resume)
    is built on the spot. The dataset's reads are index-based, so a second thread is safe.
    """

    def __init__(self, dataset, micro_batch_size: int, num_micro_batches: int,
                 global_batch_size: int, pin_memory: bool, vocab_size: int | None = None) -> None:
        self.dataset = dataset
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.global_batch_size = global_batch_size
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._ahead: tuple[int, Future] | None = None
        self._past_the_end_said = False

    def _build(self, consumed: int) -> list[dict[str, torch.Tensor]]:
        batches = list(MicroBatches(self.dataset, consumed, self.micro_batch_size,
                                    self.num_micro_batches, self.vocab_size))
        if self.pin_memory:
            batches = [{key: value.pin_memory() for key, value in batch.items()}
                       for batch in batches]
        return batches

    def iteration(self, consumed: int) -> Iterator[dict[str, torch.Tensor]]:
        if consumed + self.global_batch_size > len(self.dataset) and not self._past_the_end_said:
            self._past_the_end_said = True
            log_last_rank(
                f"warning: training reads samples {consumed} to {consumed + self.global_batch_size - 1}, "
                f"past the {len(self.dataset)} its split was built with: those past it are the "
                f"split's first samples again (a --train-samples the global batch does not divide "
                f"ends in a whole batch; a --train-iters resumed at a smaller global batch than "
                f"the checkpoint's reads past its samples, which Megatron-LM's sampler refuses)")
        ahead, self._ahead = self._ahead, None
        batches = (ahead[1].result() if ahead is not None and ahead[0] == consumed
                   else self._build(consumed))
        following = consumed + self.global_batch_size
        self._ahead = (following, self._pool.submit(self._build, following))
        return iter(batches)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
