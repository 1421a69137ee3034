"""Pretrain GPT on megatron-core, with Megatron-LM's arguments.

    python -m torch.distributed.run --nproc-per-node 4 pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...

Without torchrun it trains as a single process. Expected failures end with one line on
stderr and an exit status that tells ftmaster what happened (``ftmaster.exit_codes``):

- 2: bad arguments (before any process group exists), a checkpoint that cannot continue
  under them, or a --vocab-file/--merge-file that cannot be read as GPT-2's;
- 65: a NaN/Inf loss or gradient norm; nothing was updated or saved;
- 66: the load folder holds checkpoints and none can be loaded; nothing was changed;
- 74: the final (or SIGTERM) checkpoint could not be written;
- 79: the training data cannot be read (a corrupt corpus, or one made with another tokenizer).

Anything else is recorded in ``$TORCHELASTIC_ERROR_FILE`` (torch elastic's error file, which
ftmaster reads for the root cause) and raised.
"""

import atexit
import os
import sys
import threading
from typing import NoReturn

from megatron.training import startup

startup.mark("interpreter")

from ftmaster import exit_codes  # noqa: E402 (after the mark: the script's start is measured)
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.console import error, error_once_per_node


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as problem:
        error(str(problem))
        return exit_codes.USAGE
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from megatron.training.deferred_compile import compile_at_first_call
    with compile_at_first_call():  # heavy: the model stack
        from megatron.training.checkpointing import (CheckpointMismatch, NoLoadableCheckpoint,
                                                     PeerReadFailed)
        from megatron.training.data import DataError
        from megatron.training.nonfinite import NonFiniteLoss
        from megatron.training.tokenizer import TokenizerFileError
        from megatron.training.training import FinalSaveFailed, pretrain
    startup.mark("imports")

    expected = {CheckpointMismatch: exit_codes.USAGE, NoLoadableCheckpoint: exit_codes.NO_CHECKPOINT,
                NonFiniteLoss: exit_codes.NONFINITE, FinalSaveFailed: exit_codes.STORAGE,
                DataError: exit_codes.DATA, TokenizerFileError: exit_codes.USAGE,
                PeerReadFailed: exit_codes.PEER_READ}
    try:
        pretrain(args)
    except tuple(expected) as problem:
        # Every rank meets the others alike (they are agreed); bad data only the rank that
        # read it, which must say so itself.
        (error if isinstance(problem, DataError) else error_once_per_node)(str(problem))
        leave_now(expected[type(problem)])
    except Exception as unexpected:
        get_error_handler().record_exception(unexpected)
        raise
    return 0


def leave_now(status: int) -> NoReturn:
    """Exit with ``status`` without the interpreter's teardown. An expected failure leaves the
    process group up, and tearing gloo's threads down while the peers leave at their own pace
    can abort the rank (``terminate called without an active exception``: SIGABRT instead of
    the status, so ftmaster retried a usage error; seen in suite runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def end_without_teardown(status: int) -> NoReturn:
    """Exit as the interpreter does once main has returned, less its teardown: the other
    threads joined, every exit handler run, then out. By then everything is saved, closed
    and flushed; freeing torch's and megatron-core's modules and gloo's threads took another
    1-2.5 s of each rank's end here, time an ftmaster launch waits for. A rank that raised
    keeps the whole teardown."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the interpreter's own step (CPython), errors reported as there
    leave_now(status)


# The guard matters: async checkpoint writers start helper processes that re-import this file.
if __name__ == "__main__":
    end_without_teardown(main(sys.argv[1:]))
