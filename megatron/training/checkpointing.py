"""Distributed checkpoints in Megatron's torch_dist layout, reloadable under any TP/PP/DP.

A checkpoint holds the model and optimizer as sharded tensors (resharded on load by
``dist_checkpointing``), and in ``common.pt`` the scheduler, iteration, consumed samples,
args and layout. RNG states are per (PP, TP) rank; they are restored only when the layout is
unchanged, because a new layout has different ranks and a stale stream would be wrong.

The tracker ``latest_checkpointed_iteration.txt`` is written by rank 0 after every rank's
shards are on disk: after a barrier for a synchronous save, and in the finalize step (which
megatron-core runs only once all ranks agree their writers finished) for an async save.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Callable

import numpy
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)

from ftmaster.guard import die_with_parent
from ftmaster.recovery.checkpoints import (
    CheckpointChoice,
    find_loadable_checkpoint,
    iteration_dir,
    tracker_path,
    write_save_kind,
)
from ftmaster.runfiles import atomic_write_text

from .console import log_rank0

CHECKPOINT_VERSION = 3.0
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in Path(path).rglob("*") if entry.is_file())


def layout_of(args: argparse.Namespace) -> dict[str, int]:
    return {key: getattr(args, key) for key in _LAYOUT_KEYS}


def _rng_sharded_object() -> ShardedObject:
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject(
        "rng_state", state,
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (pp_rank, tp_rank), replica_id=parallel_state.get_data_parallel_rank())


def _restore_rng(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    numpy.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _start_writer_results_queue() -> None:
    """Start torch_dist's writer result queue now, in a server that dies with this rank.

    megatron-core creates the queue lazily through a spawn-context Manager: a fresh interpreter
    that imports torch's checkpoint classes only when it first unpickles a write result. Both
    would otherwise land in the first, possibly emergency, save (seconds to tens of seconds on
    a busy host), so a round trip of a real ``WriteResult`` pays them at start-up instead.

    Its Manager server also outlives a rank killed by a signal (about 270 MB each, and a lost
    rank is exactly what ftmaster recovers from), so ours asks for SIGKILL when its rank dies.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    queue = manager.Queue()  # the proxy keeps the manager, and so its server, alive
    queue.put({0: [WriteResult(MetadataIndex("warm-up"), 0, _StorageInfo("warm-up", 0, 0))]})
    queue.get()
    filesystem_async._results_queue = queue


class CheckpointMismatch(Exception):
    """The checkpoint cannot continue under these arguments; the message says what to pass."""


def schedule_differences(saved: dict, current: dict) -> list[str]:
    """The LR/WD schedule settings in which a checkpoint and the arguments differ (the step
    count is progress, not a setting)."""
    return [f"{key} {saved[key]} in the checkpoint, {value} now" for key, value in current.items()
            if key != "num_steps" and key in saved and saved[key] != value]


@dataclass
class TrainingState:
    """What the loop needs to continue where a checkpoint left off."""

    iteration: int = 0
    consumed_train_samples: int = 0


@dataclass(frozen=True)
class DurableSave:
    """A checkpoint whose shards are all on disk and which the tracker now names."""

    iteration: int
    path: Path
    kind: str  # periodic, emergency, exit or final: see ``SAVE_KINDS``
    started_at: float  # unix time the save began
    seconds_to_durable: float
    bytes: int


class Checkpointer:
    """Saves and loads checkpoints for one model chunk, its optimizer and its scheduler."""

    def __init__(self, args, model, optimizer, scheduler):
        self.args = args
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.async_queue = AsyncCallsQueue() if args.async_save else None
        self.last_saved_iteration: int | None = None
        if args.save:
            _start_writer_results_queue()

    # ---- saving -------------------------------------------------------------------------
    def _state_dict(self, state: TrainingState, is_loading: bool, with_rng: bool,
                    with_optimizer: bool = True) -> dict:
        model_sd = self.model.sharded_state_dict()
        sharded = {"model": model_sd, "checkpoint_version": CHECKPOINT_VERSION}
        if with_optimizer:
            # Not even built when not loaded: for loading it initialises the optimizer's
            # state, which a fresh Adam must not find half made (no "step").
            sharded["optimizer"] = self.optimizer.sharded_state_dict(model_sd,
                                                                     is_loading=is_loading)
        if with_rng:
            sharded["rng_state"] = _rng_sharded_object()
        if not is_loading:
            sharded.update(
                iteration=state.iteration,
                consumed_train_samples=state.consumed_train_samples,
                opt_param_scheduler=self.scheduler.state_dict(),
                args=vars(self.args).copy(),
                layout=layout_of(self.args),
            )
        return sharded

    def save(self, state: TrainingState, kind: str,
             on_durable: Callable[[DurableSave], None] | None = None) -> float:
        """Save at ``state.iteration``; returns the seconds training was blocked.

        ``on_durable`` runs on rank 0 once every shard is on disk and the tracker moved:
        before this returns for a synchronous save, in a later ``finalize_async`` otherwise.
        """
        path = iteration_dir(Path(self.args.save), state.iteration)
        if torch.distributed.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        started_at, start = time.time(), time.perf_counter()
        request = dist_checkpointing.save(
            self._state_dict(state, is_loading=False, with_rng=True), str(path),
            sharded_strategy=self._save_strategy(), async_sharded_save=self.async_queue is not None)
        finalize = self._finalizer(state.iteration, path, kind, started_at, start, on_durable)
        if request is None:
            torch.distributed.barrier()
            finalize()
        else:
            request.add_finalize_fn(finalize)
            self.async_queue.schedule_async_request(request)
        self.last_saved_iteration = state.iteration
        return time.perf_counter() - start

    def _save_strategy(self):
        strategy = get_default_save_sharded_strategy("torch_dist")
        return FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))

    def _finalizer(self, iteration, path, kind, started_at, start, on_durable):
        def finalize() -> None:
            if torch.distributed.get_rank() != 0:
                return
            write_save_kind(path, kind)
            atomic_write_text(tracker_path(Path(self.args.save)), f"{iteration}\n")
            done = DurableSave(iteration, path, kind, started_at, time.perf_counter() - start,
                               directory_bytes(path))
            log_rank0(f"saved {kind} checkpoint at iteration {iteration} to {path} in "
                      f"{done.seconds_to_durable:.3f} s ({done.bytes} bytes)")
            if on_durable is not None:
                on_durable(done)

        return finalize

    def finalize_async(self, blocking: bool = False) -> None:
        """Finish async saves whose writers are done on every rank (all ranks call this)."""
        if self.async_queue is not None and self.async_queue.get_num_unfinalized_calls():
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        if self.async_queue is not None:
            self.finalize_async(blocking=True)
            self.async_queue.close()

    # ---- loading ------------------------------------------------------------------------
    def load(self, state: TrainingState) -> bool:
        """Load the newest valid checkpoint under ``--load``; False when starting fresh."""
        choice = self._agreed_choice()
        log_rank0(choice.describe())
        if choice.iteration is None:
            return False
        start = time.perf_counter()
        common = dist_checkpointing.load_common_state_dict(str(choice.path))
        if not self.args.no_load_optim:
            self._check_schedule(common.get("opt_param_scheduler", {}))
        same_layout = common.get("layout") == layout_of(self.args)
        with_rng = same_layout and not self.args.no_load_rng
        template = self._state_dict(state, is_loading=True, with_rng=with_rng,
                                    with_optimizer=not self.args.no_load_optim)
        loaded = dist_checkpointing.load(template, str(choice.path),
                                         sharded_strategy=self._load_strategy(choice.path))
        self._apply(loaded, state, with_rng)
        seconds = time.perf_counter() - start
        log_rank0(f"loaded checkpoint from {choice.path} at iteration {state.iteration} in "
                  f"{seconds:.3f} s ({directory_bytes(choice.path)} bytes); layout "
                  f"{common.get('layout')} -> {layout_of(self.args)}"
                  + ("" if with_rng else "; RNG state not restored"))
        self.last_saved_iteration = state.iteration
        return True

    def _check_schedule(self, saved: dict) -> None:
        """Megatron-LM's rule: a resume keeps the schedule unless told which one to follow,
        so that a changed --train-iters or --lr never silently keeps the old decay."""
        if self.args.override_opt_param_scheduler or self.args.use_checkpoint_opt_param_scheduler:
            return
        differences = schedule_differences(saved, self.scheduler.state_dict())
        if differences:
            raise CheckpointMismatch(
                f"the learning-rate schedule differs from the checkpoint's ({'; '.join(differences)}): "
                f"pass --override-opt-param-scheduler to follow the arguments, or "
                f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")

    def _agreed_choice(self) -> CheckpointChoice:
        """Rank 0 looks on disk once; every rank loads the same iteration."""
        choice = [find_loadable_checkpoint(Path(self.args.load))
                  if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(choice, src=0)
        return choice[0]

    def _load_strategy(self, path: Path):
        strategy = get_default_load_sharded_strategy(str(path))
        return FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))

    def _apply(self, loaded: dict, state: TrainingState, with_rng: bool) -> None:
        self.model.load_state_dict(loaded["model"])
        if with_rng:
            _restore_rng(loaded["rng_state"])
        state.iteration = int(loaded["iteration"])
        state.consumed_train_samples = int(loaded["consumed_train_samples"])
        if self.args.no_load_optim:
            # A fresh optimizer, but the schedule (counted in samples) goes on where it was.
            # (dist_checkpointing hands back the common part of "optimizer" even when the
            # template left it out, so the flag, not the key, decides.)
            self.scheduler.step(increment=state.consumed_train_samples)
        else:
            self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])


def checkpoint_args(load_dir: str | None) -> dict | None:
    """The args saved with the checkpoint that ``--load`` would pick, without loading it."""
    if not load_dir:
        return None
    choice = find_loadable_checkpoint(Path(load_dir))
    if choice.iteration is None:
        return None
    return dist_checkpointing.load_common_state_dict(str(choice.path)).get("args")
