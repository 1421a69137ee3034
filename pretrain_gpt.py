"""Pretrain GPT on megatron-core, with Megatron-LM's arguments.

    python -m torch.distributed.run --nproc-per-node 4 pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...

Bad arguments end with one line on stderr and exit status 2, before any process group exists;
so does a checkpoint that cannot continue under them. Without torchrun it trains as a single
process.
"""

import sys

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.console import error, error_rank0


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as problem:
        error(str(problem))
        return 2
    from megatron.training.checkpointing import CheckpointMismatch
    from megatron.training.training import pretrain  # heavy: imports the model stack

    try:
        pretrain(args)
    except CheckpointMismatch as problem:
        error_rank0(str(problem))
        return 2
    return 0


# The guard matters: async checkpoint writers start helper processes that re-import this file.
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
