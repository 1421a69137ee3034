"""The training loop: megatron-core GPT, pipeline schedules, Megatron DDP and optimizer.

``pretrain(argv)`` is the whole program behind ``pretrain_gpt.py``. It runs on CUDA + NCCL
when CUDA is present and on CPU + gloo otherwise (see ``cpu_compat``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from ftmaster import runfiles
from ftmaster.guard import forked_children_die_with_this_process
from ftmaster.recovery.replicas import unavailable_reason

from . import console, cpu_compat, mcore_fixes, optimizer_shards, rehearsal, startup
from .arguments import make_checkpoint_folders, padded_vocab_size
from .checkpointing import (
    Checkpointer,
    DurableSave,
    SaveFailure,
    TrainingState,
    checkpoint_args,
    prune_emergency_checkpoints,
)
from .console import format_iteration_line, local_rank, log_last_rank, log_rank0
from .data import BatchPrefetcher, MicroBatches, build_datasets
from .model import (build_model, build_optimizer, connect_schedule_hooks, needs_data,
                    transformer_config, uses_distributed_optimizer, uses_transformer_engine)
from .nonfinite import NonFiniteGuard, NonFiniteLoss, loss_scale_held_back, prepare_update
from .tensorboard import Board
from .rehearsal import kill_point
from .replicas import Cut, ReplicaDumper
from .save_requests import SaveRequests, median_microseconds
from .step_timing import ComputeFigures, ComputeTimer
from .tokenizer import build_tokenizer


class FinalSaveFailed(Exception):
    """The checkpoint at the end of training (or on SIGTERM) could not be written."""


@dataclass
class _OneSave:
    """One save, as the trainer follows it to its end."""

    ended: bool = False
    """Its callback ran: inside the call for a synchronous save."""
    blocked: float | None = None
    """The seconds training was blocked, for a save still written after the call returned."""


# ---- initialisation -----------------------------------------------------------------------
def distributed_timeout(args) -> datetime.timedelta:
    return datetime.timedelta(minutes=args.distributed_timeout_minutes)


def initialize(args: argparse.Namespace) -> None:
    """Process group, model-parallel groups and seeds."""
    forked_children_die_with_this_process()
    rehearsal.arm_cuda_errors(local_rank())
    rehearsal.arm_kill_points(local_rank())
    use_cuda = torch.cuda.is_available()
    device = {}
    if use_cuda:
        torch.cuda.set_device(local_rank())
        # Eager NCCL initialisation on this device, and no guessing of it later.
        device = {"device_id": torch.device("cuda", local_rank())}
    else:
        cpu_compat.apply()
    mcore_fixes.apply()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=distributed_timeout(args),
            **device, **_single_process_rendezvous())
    # The timeout reaches the TP, PP and DP groups too (megatron-core's default is 30 min,
    # longer than any --hang-timeout ftmaster would use).
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    startup.mark("process-group")


def _single_process_rendezvous() -> dict:
    """Without torchrun (no ``RANK`` in the environment) train as the only process, with an
    in-memory store, rather than fail on the missing rendezvous variables."""
    if "RANK" in os.environ:
        return {}
    return {"store": torch.distributed.HashStore(), "rank": 0, "world_size": 1}


def resumed_checkpoint_args(args) -> dict:
    """The args saved with the checkpoint a load would pick (read on rank 0, given to every
    rank); empty without one."""
    memory = (args.non_persistent_global_ckpt_dir if args.non_persistent_ckpt_type == "global"
              else None)
    saved = (checkpoint_args(args.load, memory and Path(memory))
             if torch.distributed.get_rank() == 0 else None)
    box = [saved or {}]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def vocab_size_for_layout(args, tokenizer, saved: dict) -> int:
    """Megatron's padded vocabulary, kept from the checkpoint when it fits the new TP.

    The padding depends on TP, so a resharded resume would otherwise build an embedding of
    another shape than the checkpoint's.
    """
    kept = saved.get("padded_vocab_size")
    if kept and kept % args.tensor_model_parallel_size == 0 and kept >= tokenizer.vocab_size:
        return kept
    return padded_vocab_size(tokenizer.vocab_size, args)


def layer_implementation(args, saved: dict) -> str:
    """The layers this run builds, saved with its checkpoints: Transformer Engine's where it
    is used, else megatron-core's local ones. A checkpoint of local layers (saved on CPU,
    say) holds no Transformer Engine state (``_extra_state``) to load into its layers, so a
    resume from one keeps the local layers, saying so."""
    if not uses_transformer_engine(args):
        return "local"
    if saved.get("transformer_impl") == "local":
        log_rank0("warning: the checkpoint was saved from megatron-core's local layers (no "
                  "Transformer Engine state): resuming with the local layers; start a new run "
                  "from its weights to use Transformer Engine")
        return "local"
    return "transformer_engine"


def optimizer_choice(args, saved: dict) -> bool:
    """``--use-distributed-optimizer``, or its default; by default not the distributed
    optimizer when the checkpoint resumed holds the plain optimizer's state, which it cannot
    read. A relaunch's default had switched it: under ``--replica-recovery`` on CUDA with two
    instances, a DP3 relaunch runs one instance, so the plain optimizer, and the next relaunch
    back at two instances refused the plain checkpoint (exit 2, the run given up). Not when
    ``--overlap-param-gather`` was asked for: it gathers the distributed optimizer's shards."""
    chosen = uses_distributed_optimizer(args)
    if (args.distributed_optimizer_by_default and chosen and not args.no_load_optim
            and not args.overlap_param_gather
            and saved.get("use_distributed_optimizer") is False):
        log_rank0("the checkpoint holds the plain optimizer's state, which the distributed "
                  "optimizer cannot read: resuming with the plain optimizer, one instance (give "
                  "--use-distributed-optimizer --no-load-optim to switch, its state afresh)")
        return False
    return chosen


# ---- one iteration ------------------------------------------------------------------------
def _to_device(batch: dict) -> dict:
    if torch.cuda.is_available():
        return {key: value.cuda(non_blocking=True) for key, value in batch.items()}
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # clone: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    if data_iterator is None:  # a middle pipeline stage reads its input from the previous one
        output = model(None, None, None)
        return output, partial(loss_func, None)
    batch = _to_device(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _average_loss(losses: list[dict]) -> float | None:
    """Mean over micro-batches and data-parallel ranks, on the last pipeline stage."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not losses:
        return None
    value = torch.stack([entry["lm loss"] for entry in losses]).mean().float().reshape(1)
    torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / parallel_state.get_data_parallel_world_size()


def describe_layout(args) -> str:
    """One start-up line: where the job trains and how it is split."""
    device = f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    virtual = (f" x {args.virtual_pipeline_model_parallel_size} virtual stages"
               if args.virtual_pipeline_model_parallel_size else "")
    instances = args.num_distributed_optimizer_instances
    optimizer = ("replicated" if not args.use_distributed_optimizer else
                 f"distributed ({instances} instances)" if instances > 1 else "distributed")
    return (f"training on {args.world_size} {device} ranks: TP {args.tensor_model_parallel_size} "
            f"x PP {args.pipeline_model_parallel_size}{virtual} x DP {args.data_parallel_size}, "
            f"{precision}, {optimizer} optimizer state"
            f"{', sequence parallel' if args.sequence_parallel else ''}")


class LogWindow:
    """The iterations since the last logged line: their losses, and their time as Megatron-LM's
    ``interval-time`` timer counts it, evaluation and checkpointing left out (it stops around
    both): counted, the iteration after each read many times its neighbours, and the medians
    read from the log (goodput's iteration time) took them in."""

    def __init__(self, iteration: int) -> None:
        self.begin(iteration)

    def begin(self, iteration: int) -> None:
        self.started, self.losses, self.first = time.perf_counter(), [], iteration

    def elapsed_ms(self, iteration: int) -> float:
        """Per iteration up to ``iteration``: after a resume the first window holds fewer
        than --log-interval, as Megatron-LM counts them."""
        return (time.perf_counter() - self.started) * 1000 / max(1, iteration - self.first)

    @contextlib.contextmanager
    def left_out(self):
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - paused


class Trainer:
    def __init__(self, args):
        self.args = args
        saved = resumed_checkpoint_args(args)
        # Resolved once, where CUDA is known, and saved so that a resume can tell.
        args.use_distributed_optimizer = optimizer_choice(args, saved)
        if not args.use_distributed_optimizer:  # the default gave way to a plain checkpoint:
            args.num_distributed_optimizer_instances = 1  # partial sharding needs the other
        self.run_dir = runfiles.run_dir_from_env()
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.vocab_file,
                                    args.merge_file)
        args.padded_vocab_size = vocab_size_for_layout(args, tokenizer, saved)
        args.transformer_impl = layer_implementation(args, saved)
        self.config = transformer_config(args)
        self.model = build_model(args, self.config, args.padded_vocab_size)
        self.optimizer, self.scheduler = build_optimizer(args, self.model)
        startup.mark("model-and-optimizer-setup")
        connect_schedule_hooks(self.config, self.model, self.optimizer)
        self.compute = ComputeTimer(cuda=torch.cuda.is_available())
        self.slowdown = rehearsal.Slowdown(local_rank())
        self._hook_grad_reduction()
        self.train_ds, self.valid_ds, _ = build_datasets(args, tokenizer)
        self.vocab_limit = None if args.mock_data else tokenizer.vocab_size
        self.state = TrainingState()
        # One CPU group for every agreement the loop makes (save requests, the NaN guard,
        # the outcome of each save and load): none of them ever waits on a GPU stream.
        self.control_group = torch.distributed.new_group(backend="gloo",
                                                         timeout=distributed_timeout(args))
        self.checkpointer = Checkpointer(args, self.model, self.optimizer, self.scheduler,
                                         self.control_group, self._event)
        self.num_micro_batches = args.global_batch_size // (
            args.micro_batch_size * parallel_state.get_data_parallel_world_size())
        self.train_batches = BatchPrefetcher(
            self.train_ds, args.micro_batch_size, self.num_micro_batches,
            args.global_batch_size, pin_memory=torch.cuda.is_available(),
            vocab_size=self.vocab_limit) if needs_data() else None
        # The interleaved schedule takes one iterator per chunk; chunks that read no data get
        # None (the first stage's first chunk reads tokens, the last stage's last labels).
        stages = args.virtual_pipeline_model_parallel_size
        self.chunk_reads = [needs_data(stage) for stage in range(stages)] if stages else None
        self.forward_backward = get_forward_backward_func()
        self.requests = SaveRequests(
            flag_path=self._flag_path(), handle_sigterm=args.exit_signal_handler,
            gap_frac=args.emergency_save_gap_frac, save_interval=args.save_interval,
            can_save=args.save is not None, group=self.control_group,
            memory_interval=args.non_persistent_save_interval,
            ranks=torch.distributed.get_world_size(), rank=torch.distributed.get_rank())
        self.figures = ComputeFigures(*self._stages_and_replicas())
        self.guard = NonFiniteGuard(self.control_group, args.check_for_nan_in_loss_and_grad)
        self.cut = Cut(enabled=args.replica_recovery)
        self.replicas = self._replica_dumper()
        self.poison_at = rehearsal.nan_iterations(local_rank())
        self._first_iteration: int | None = None  # set once a checkpoint is (not) loaded
        self._final_save_failure: SaveFailure | None = None
        self._ended_at: int | None = None
        """The iteration the loop stopped at: a save of it is the attempt's last checkpoint."""
        self._stopped_on_signal = False  # an agreed exit on SIGTERM, before the schedule's end
        self._retry_on_disk: str | None = None  # the kind of a memory save that did not fit
        self.run_files = runfiles.WriteOutage(
            console.error, console.error_line, "training goes on, but ftmaster does not see it")
        self.grad_norm: float | None = None  # the last iteration's, where it was computed
        self.board: Board | None = None  # TensorBoard, once the starting iteration is known
        log_rank0(describe_layout(args))
        if torch.cuda.is_available():  # which GPUs, as ftmaster named them (UUIDs)
            log_rank0(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset: all)')}")
        startup.mark("train/valid/test-data-iterators-setup")

    def _replica_dumper(self) -> ReplicaDumper | None:
        """The dump thread of ``--replica-recovery`` (under ftmaster: it asks for the dump)."""
        if not self.args.replica_recovery or self.run_dir is None:
            return None
        if not self.args.use_distributed_optimizer:
            return ReplicaDumper(self.run_dir, self.cut, self.state, self.checkpointer.state_dict_at)
        refusal = unavailable_reason(self.args.replica_recovery, self.args.use_distributed_optimizer,
                                     self.args.num_distributed_optimizer_instances)
        if refusal is not None:
            log_rank0(f"warning: {refusal}")
        shard = optimizer_shards.position(self.optimizer)
        return ReplicaDumper(
            self.run_dir, self.cut, self.state, self.checkpointer.state_dict_at, refusal,
            optimizer_slices=partial(optimizer_shards.shard_slices, self.optimizer),
            coordinates={"instance": shard.instance, "optimizer_shard": shard.shard,
                         "optimizer_shards": shard.shards})

    def park(self, error: BaseException) -> None:
        """Training ends on ``error``: a peer's death keeps this rank until its dump is out."""
        if self.replicas is not None:
            self.replicas.park(error)

    def _hook_grad_reduction(self) -> None:
        """The schedule's gradient reduction ends this rank's compute (``step_timing``). A
        rehearsal slows the rank down just before it, or kills the rank as it starts."""
        finalize = self.config.finalize_model_grads_func
        killing = rehearsal.kill_armed("grad-allreduce")

        def finalize_timed(*args, **kwargs):
            factor = self.slowdown.current(self.state.iteration + 1)
            if factor > 1:
                self.compute.slow_down(factor)
            self.compute.reduction_entered()
            if killing:
                kill_point("grad-allreduce", self.state.iteration + 1)
            return finalize(*args, **kwargs)

        self.config.finalize_model_grads_func = finalize_timed

    def _stages_and_replicas(self) -> tuple[list[int], list[int]]:
        """Every rank's pipeline stage and model replica (straggler detection compares ranks
        of one stage, and knows that ranks of one replica wait for each other)."""
        ranks = [(0, 0)] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(
            ranks, (parallel_state.get_pipeline_model_parallel_rank(),
                    parallel_state.get_data_parallel_rank()), group=self.control_group)
        return [stage for stage, _ in ranks], [replica for _, replica in ranks]

    def _flag_path(self) -> Path | None:
        if self.args.emergency_save_flag_dir:
            return Path(self.args.emergency_save_flag_dir) / runfiles.SAVE_NOW_FLAG
        return runfiles.save_now_flag_path(self.run_dir) if self.run_dir else None

    def _per_chunk(self, batches):
        """One iterator per model chunk that reads data (a list under virtual stages)."""
        if self.chunk_reads is None:
            return None if batches is None else iter(batches)
        return [iter(batches) if reads else None for reads in self.chunk_reads]

    def _data(self, dataset, consumed):
        if not needs_data():
            return self._per_chunk(None)
        return self._per_chunk(list(MicroBatches(dataset, consumed, self.args.micro_batch_size,
                                                 self.num_micro_batches, self.vocab_limit)))

    def train_step(self) -> float | None:
        """One iteration, the counters advanced with the update (see ``replicas.Cut``);
        NonFiniteLoss (on every rank, before any update) when the guard finds a NaN or Inf."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        data = (None if self.train_batches is None
                else list(self.train_batches.iteration(self.state.consumed_train_samples)))
        iteration = self.state.iteration + 1
        kill_point("forward", iteration)
        losses = self.forward_backward(
            forward_step_func=forward_step, data_iterator=self._per_chunk(data),
            model=self.model.chunks, num_microbatches=self.num_micro_batches,
            seq_length=self.args.seq_length, micro_batch_size=self.args.micro_batch_size,
            forward_only=False)
        loss = _average_loss(losses)
        with loss_scale_held_back(self.optimizer) as loss_scale:
            ready, self.grad_norm = prepare_update(
                self.optimizer, self.args.clip_grad, iteration, loss, self.guard,
                poison=iteration in self.poison_at, agreement=self.cut.agreement,
                hold_loss_scale=loss_scale.hold)
        with self.cut.commit():
            loss_scale.move()
            # fp16 skips a step whose gradients overflowed; so does the LR
            if ready and self.optimizer.step_with_ready_grads():
                self.scheduler.step(increment=self.args.global_batch_size)
            self.state.iteration = iteration
            self.state.consumed_train_samples += self.args.global_batch_size
        kill_point("update", iteration)
        return loss

    def evaluate(self) -> None:
        consumed = self.state.iteration // self.args.eval_interval * self.args.eval_iters
        losses = []
        self.model.sync_params()
        self.model.train(False)
        with torch.no_grad():
            for step in range(self.args.eval_iters):
                batch_start = (consumed + step) * self.args.global_batch_size
                losses += self.forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=self._data(self.valid_ds, batch_start), model=self.model.chunks,
                    num_microbatches=self.num_micro_batches, seq_length=self.args.seq_length,
                    micro_batch_size=self.args.micro_batch_size, forward_only=True)
                # progress for the hang check: --eval-iters steps can outlast --hang-timeout
                self._heartbeat(evaluated=step + 1)
        self.model.train()
        loss = _average_loss(losses)
        if loss is not None:  # Megatron-LM's line, its perplexity capped as there
            log_last_rank(f"validation loss at iteration {self.state.iteration} | "
                          f"lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20, loss)):.6E} |")
        self.board.validation(self.state.iteration, loss)

    # ---- checkpoint events ------------------------------------------------------------------
    @property
    def writes_run_files(self) -> bool:
        """Each node's local rank 0 writes its node's heartbeat and events (the run folder of
        that node's ftmaster), so every node's supervisor sees the progress of its ranks."""
        return self.run_dir is not None and local_rank() == 0

    def _event(self, name: str, **fields) -> None:
        if self.writes_run_files:
            self.run_files.append_event(self.run_dir, name, **fields)

    def save(self, kind: str, tier: str = "disk") -> None:
        self.model.sync_params()
        if kind in ("final", "exit") or self._saves_last_state():
            # No later save would answer a request standing now (one still waiting out the
            # gap filter, say): this one does, or the next run on the folder saves unasked.
            self.requests.answer_with_last_save(self.state.iteration)
        save = _OneSave()
        blocked = self.checkpointer.save(self.state, kind, tier,
                                         on_durable=partial(self._on_durable, save),
                                         on_failed=partial(self._on_save_failed, save))
        if not save.ended:  # written on in the background (a memory save never is)
            save.blocked = blocked
            where = " in memory" if tier == "memory" else ""
            log_rank0(f"async {kind} save at iteration {self.state.iteration}{where} started; "
                      f"training blocked {blocked:.3f} s")

    def _on_save_failed(self, save: "_OneSave", failure: SaveFailure) -> None:
        """Every rank: training goes on; an answered request is not asked again (the
        monitor asks anew if the GPU stays critical); the end of training must say so."""
        save.ended = True
        if failure.tier == "memory":  # the request goes to disk instead
            self._retry_on_disk = failure.kind
            return
        self._consume_answered_flag(failure.iteration)
        # An async save of the iteration the loop stopped at (--exit-interval skips its own
        # save when one is under way) failing as it is waited for: the end said success
        # without its last checkpoint.
        last = self._ended_at if self._ended_at is not None else (
            self.state.iteration if self._training_done() else None)
        if failure.kind in ("final", "exit") or failure.iteration == last:
            self._final_save_failure = failure  # no second try at the same iteration

    def _on_durable(self, save: "_OneSave", done: DurableSave) -> None:
        """Every rank, once a checkpoint is complete on disk: each node's event and flag,
        and on rank 0 the pruning of older emergency checkpoints."""
        save.ended = True
        blocked = save.blocked if save.blocked is not None else done.seconds_to_durable
        self._event("emergency_save" if done.kind == "emergency" else "periodic_save",
                    iteration=done.iteration, seconds=round(blocked, 4),
                    waited_for_ranks_seconds=round(done.waited_for_ranks, 4), bytes=done.bytes,
                    persist_seconds=round(done.seconds_to_durable, 4),
                    started_at=round(done.started_at, 4), kind=done.kind, tier=done.tier,
                    checksum_seconds=round(done.hash_seconds, 4),
                    writer_seconds=round(done.write_seconds, 4),
                    structure="same" if done.structure_kept else "new",
                    **({"slot": done.slot} if done.slot else {}),
                    **({"already_on_disk": True} if done.already_on_disk else {}),
                    # the schedule's end, whatever its unit (--train-samples included)
                    **({"ends_schedule": True} if done.iteration == self.state.iteration
                       and self._training_done() else {}),
                    phases={name: round(value, 4) for name, value in done.phases.items()},
                    writer_phases={name: round(value, 4)
                                   for name, value in done.writer_phases.items()})
        self._consume_answered_flag(done.iteration)
        if self.board is not None:  # what a relaunch resumes from is on disk in the curves too
            self.board.flush()
        if (self.args.keep_emergency is not None and done.tier == "disk"
                and torch.distributed.get_rank() == 0):
            self.checkpointer.janitor.submit(prune_emergency_checkpoints, Path(self.args.save),
                                             self.args.keep_emergency)

    def _consume_answered_flag(self, iteration: int) -> None:
        """Each node's local rank 0 removes the flag its ranks answered with the save at
        ``iteration``, with or without a run directory (``--emergency-save-flag-dir`` alone)."""
        if local_rank() == 0:
            self.requests.consume(iteration)

    def _heartbeat(self, finished: bool = False, evaluated: int | None = None) -> None:
        if self.writes_run_files:
            self.run_files.write(runfiles.heartbeat_path(self.run_dir), partial(
                runfiles.write_heartbeat, self.run_dir, self.state.iteration,
                self.state.consumed_train_samples, self._first_iteration, finished=finished,
                compute=self.figures.heartbeat(), evaluated=evaluated))

    def _after_iteration(self) -> bool:
        """Checkpoint bookkeeping after an iteration; True when training must stop now."""
        self.checkpointer.finalize_async()
        last = self.checkpointer.last_saved_iteration or 0
        kill_point("save-agreement", self.state.iteration)
        decision = self.requests.decide(self.state.iteration, last)
        self.figures.record(self.state.iteration - 1, self.requests.compute_us)
        if decision.deferred_until is not None:
            self._event("save_deferred", iteration=self.state.iteration,
                        until_iteration=decision.deferred_until)
        # The last iteration's checkpoint is the final one, on disk, not a memory copy.
        if decision.save and not (decision.memory and self._saves_last_state()):
            self.save("emergency" if decision.emergency else "exit" if decision.exit
                      else "periodic", self._tier(decision))
        self._save_on_disk_after_memory_failure()
        if decision.exit:
            log_rank0(f"exiting on SIGTERM after iteration {self.state.iteration}")
            # Agreed at the last iteration, the exit save is training's final checkpoint.
            self._stopped_on_signal = not self._training_done()
        return decision.exit or self._exit_interval_reached()

    def _tier(self, decision) -> str:
        """Emergency and interval saves go to the memory tier when it is on; periodic, exit
        and final saves to disk."""
        # The last iteration's save is the run's final one: on disk, never a memory copy that
        # a persist would race the final save with.
        to_memory = ((decision.memory or decision.emergency) and not decision.exit
                     and not self._saves_last_state())
        return "memory" if to_memory and self.checkpointer.memory_dir is not None else "disk"

    def _save_on_disk_after_memory_failure(self) -> None:
        """Every rank alike (the failure was agreed): a memory save that failed (the tier is
        full) is made again on disk, with the state as it is now."""
        if self._retry_on_disk is not None:
            kind, self._retry_on_disk = self._retry_on_disk, None
            if self.checkpointer.last_saved_iteration != self.state.iteration:
                self.save(kind, "disk")

    def _exit_interval_reached(self) -> bool:
        if not self._exit_interval_due():
            return False
        if self.args.save and not self.checkpointer.on_disk_at(self.state.iteration):
            self.save("exit")
        log_rank0(f"exiting at iteration {self.state.iteration} "
                  f"(--exit-interval {self.args.exit_interval})")
        return True

    def _exit_interval_due(self) -> bool:
        interval = self.args.exit_interval
        return bool(interval) and self.state.iteration % interval == 0

    def _saves_last_state(self) -> bool:
        """Whether a save now holds the run's last state: at its end, or at --exit-interval's
        stop. Such a save goes to disk, and answers a request standing (the next run on the
        folder would save it unasked)."""
        return self._training_done() or self._exit_interval_due()

    def _training_done(self) -> bool:
        """The run ends at ``--train-iters``, as Megatron-LM's does (a resume at another
        global batch ended elsewhere: DESIGN's contract, and the supervisor's end of the
        schedule, are that iteration); with ``--train-samples`` once the consumed samples
        reach it, whatever the batch was before a resume (ftmaster's own batch changes
        rewrite the schedule into samples: ``recovery/batch_schedule.py``)."""
        if self.args.train_iters is not None:
            return self.state.iteration >= self.args.train_iters
        return self.state.consumed_train_samples >= self.args.train_samples

    def run(self) -> None:
        """Train to the end of the schedule (or an exit request). NonFiniteLoss leaves it with
        nothing updated; FinalSaveFailed once training ended without its last checkpoint."""
        args = self.args
        loaded = bool(args.load) and self.checkpointer.load(self.state)
        if not loaded:
            self.checkpointer.prepare_fresh_start()
        self._first_iteration = self.state.iteration + 1
        self.cut.begin()
        self.board = Board(args, self._first_iteration)
        remaining = max(0, args.train_samples - self.state.consumed_train_samples)
        self.total_iterations = (max(self.state.iteration, args.train_iters)
                                 if args.train_iters is not None
                                 else self.state.iteration + -(-remaining // args.global_batch_size))
        log_rank0(f"training from iteration {self.state.iteration} to {self.total_iterations}")
        window = LogWindow(self.state.iteration)
        while not self._training_done():
            self.compute.start()
            started = time.perf_counter()
            self.requests.start_agreement(self.compute.previous_microseconds())
            loss = self.train_step()
            self._board_iteration(loss, time.perf_counter() - started)
            self._heartbeat()
            if self.state.iteration == self._first_iteration:
                startup.mark("first-iteration")
                self._event("startup", **startup.agree(self.control_group))
            if loss is not None:
                window.losses.append(loss)
            if self.state.iteration % args.log_interval == 0:
                self._log(window)
                window.begin(self.state.iteration)
            with window.left_out():
                if args.eval_iters and self.state.iteration % args.eval_interval == 0:
                    self.evaluate()
                done = self._after_iteration()
            if done:
                break
        else:  # saved first, as Megatron-LM's pretrain: an evaluation that fails loses nothing
            self._final_save()
            self._evaluate_at_the_end()
        self._ended_at = self.state.iteration
        self.checkpointer.close()
        self.board.close()
        if self.train_batches is not None:
            self.train_batches.close()
        self._report_check_cost()
        if self._final_save_failure is not None:
            failure = self._final_save_failure
            raise FinalSaveFailed(f"training ended at iteration {self.state.iteration} without "
                                  f"its last checkpoint: the {failure.kind} save to "
                                  f"{failure.path} failed: {failure.reason}")
        # A stop on a signal is no end of training: a supervisor that did not send it resumes.
        self._heartbeat(finished=not self._stopped_on_signal)

    def _board_iteration(self, loss: float | None, seconds: float) -> None:
        if not self.board.due(self.state.iteration):
            return
        loss_scale = self.optimizer.get_loss_scale().item() if self.args.fp16 else None
        self.board.iteration(self.state.iteration, loss=loss,
                             learning_rate=self.optimizer.param_groups[0]["lr"],
                             batch_size=self.args.global_batch_size,
                             grad_norm=self.grad_norm, loss_scale=loss_scale, seconds=seconds)

    def stop_after_nonfinite(self, problem: NonFiniteLoss) -> None:
        """Every rank, at the same point: earlier saves still complete; the bad one is not
        saved."""
        self._event("nonfinite", iteration=problem.iteration, what=problem.what)
        self.checkpointer.close()

    def _report_check_cost(self) -> None:
        cost = median_microseconds(self.requests.check_seconds)
        if cost is not None:
            log_rank0(f"save-request check: median {cost:.1f} us per iteration over "
                      f"{len(self.requests.check_seconds)} iterations")

    def _evaluate_at_the_end(self) -> None:
        """Megatron-LM evaluates once more when training ends: a run shorter than
        --eval-interval (1000 by default) reported no validation loss at all. Not again at an
        iteration that evaluated, nor for a run that trained none (resumed at its end)."""
        args = self.args
        if (args.eval_iters and self.state.iteration >= self._first_iteration
                and self.state.iteration % args.eval_interval):
            self.evaluate()

    def _final_save(self) -> None:
        if (self.args.save and not self.checkpointer.on_disk_at(self.state.iteration)
                and self._final_save_failure is None):
            self.save("final")

    def _log(self, window: LogWindow) -> None:
        losses = window.losses
        log_last_rank(format_iteration_line(
            self.state.iteration, self.total_iterations, self.state.consumed_train_samples,
            window.elapsed_ms(self.state.iteration), self.optimizer.param_groups[0]["lr"],
            self.args.global_batch_size, sum(losses) / len(losses) if losses else None))


def pretrain(args: argparse.Namespace) -> None:
    make_checkpoint_folders(args)
    initialize(args)
    trainer = Trainer(args)
    try:
        trainer.run()
    except NonFiniteLoss as problem:
        trainer.stop_after_nonfinite(problem)
        raise
    except Exception as error:
        trainer.park(error)
        raise
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
