"""Recovery from surviving replicas, the supervisor's side (training's ``--replica-recovery``).

When an attempt fails, and before it is killed, the supervisor asks every rank for a dump
(``flags/replica_dump.json`` naming ``MEMORY/replicas/attempt_<N>``) and waits until each
rank has reported or ended, at most :data:`DUMP_TIMEOUT_S` (torchrun SIGKILLs the survivors
30 s after the failure). Then it starts the merge
(``python -m megatron.training.replica_merge``, which imports torch: the supervisor does
not; on a warm worker when one is ready, see :mod:`ftmaster.warm`), kills the attempt while
the merge runs, and the relaunch loads the merged checkpoint
like any other. Whenever there is no complete cut (DP 1, a hang with no known culprit, a
survivor that refused or was lost), one line says why and the relaunch falls back to the
newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ftmaster import runfiles
from ftmaster.attempt import Attempt
from ftmaster.guard import dying_with_this_process, naming_this_process
from ftmaster.monitor.backends.bounded import STOP_POLL_S, Abandoned
from ftmaster.recovery.checkpoints import read_tracker
from ftmaster.recovery.replicas import (REQUEST_FLAG, NoCut, choose_cut, dump_folder,
                                       read_reports, remove_merge_leftovers,
                                       remove_recovery_leftovers, report_path,
                                       round_dump_folder, unavailable_reason)
from ftmaster.recovery.argv_flags import int_flag, switched_on
from ftmaster.warm import WarmRanks, WarmStarter

FLAG = "--replica-recovery"
DUMP_TIMEOUT_S = 20.0
MERGE_TIMEOUT_S = 300.0
# Causes whose state is worth dumping: a rank or GPU that died, or a hang whose culprit is
# known (its own dump never comes). The others end the run, or would repeat from any state.
# Across nodes a node whose ranks lost a peer on another node dumps too ("peer").
DUMPED_CAUSES = ("exit", "device_lost", "hang")
DUMPED_ACROSS_NODES = (*DUMPED_CAUSES, "peer")

log = logging.getLogger("ftmaster")


def unavailable_in(args: Sequence[str]) -> str | None:
    """Why the training arguments' ``--replica-recovery`` cannot work, or None; for arguments
    the planner has read (its flags' values are checked). Only an explicit
    ``--use-distributed-optimizer`` turns it on with one instance: the trainer's default
    leaves it off there."""
    instances = int_flag(args, "--num-distributed-optimizer-instances", 1)  # checked by now
    return unavailable_reason(FLAG in args, switched_on(args, "--use-distributed-optimizer"),
                              instances)


@dataclass(frozen=True)
class Merging:
    """A merge under way."""

    folder: Path
    process: subprocess.Popen | WarmRanks
    started: float
    output: Path | None = None
    """Where a warm worker writes the merge's output; None: the process's stdout pipe."""


def merge_output(merging: Merging, stop: threading.Event | None = None) -> tuple[str, str]:
    """What the merge printed, and what it said besides (its stderr; a warm worker writes both
    to one file), once it ended. Past the timeout (subprocess.TimeoutExpired) or once ``stop``
    is set (Abandoned: SLURM's SIGKILL comes sooner) the merge is killed, which leaves its
    checkpoint either whole (renamed into place) or a staging folder to remove."""
    deadline = time.monotonic() + MERGE_TIMEOUT_S
    stop = stop or threading.Event()  # none: only the timeout ends the wait
    try:
        while True:
            try:
                return _output_by(merging, min(deadline, time.monotonic() + STOP_POLL_S))
            except subprocess.TimeoutExpired:
                if stop.is_set():
                    raise Abandoned("stopped waiting for the replica merge") from None
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired("replica merge", MERGE_TIMEOUT_S) from None
    except (subprocess.TimeoutExpired, Abandoned):
        merging.process.kill()
        merging.process.wait()
        raise


def _output_by(merging: Merging, until: float) -> tuple[str, str]:
    """The merge's output if it ends by ``until``; subprocess.TimeoutExpired if not."""
    if merging.output is None:  # communicate again after its timeout loses nothing
        return merging.process.communicate(timeout=max(0.0, until - time.monotonic()))
    while not _said_it(merging.output) and merging.process.poll() is None:
        if time.monotonic() > until:
            raise subprocess.TimeoutExpired("replica merge", MERGE_TIMEOUT_S)
        time.sleep(0.01)
    # Its answer is its last act: the worker's own exit (the async writers' Manager it started
    # shutting down) would add a second to the recovery.
    merging.process.kill()
    try:
        said = merging.output.read_text(errors="replace")
    except OSError:  # a worker that ended before it opened its output said nothing
        said = ""
    return said, said


def _last_words(said: str) -> str:
    lines = [line for line in said.splitlines() if line.strip()]
    return f": {lines[-1][-300:]}" if lines else ""


def _said_it(output: Path) -> bool:
    """The merge printed its one JSON line, whole."""
    try:
        text = output.read_text(errors="replace")
    except OSError:
        return False
    return text.endswith("\n") and text.splitlines()[-1].startswith("{")


def request_flag_path(run_dir: Path) -> Path:
    return runfiles.flags_dir(run_dir) / REQUEST_FLAG


class ReplicaRecovery:
    """Dump, then merge, for one failed attempt at a time."""

    def __init__(self, run_dir: Path, memory_dir: Path, save_dir: Path,
                 event: Callable[..., dict], starter: WarmStarter | None = None) -> None:
        self.run_dir, self.memory_dir, self.save_dir = Path(run_dir), memory_dir, save_dir
        self.event = event
        self.starter = starter
        self.round: tuple[int, int] | None = None
        """Across nodes: the current round's number and this node's first global rank."""
        # Dumps there are an earlier ftmaster's, never merged (it was killed or requeued between
        # its dumps and their merge): across nodes the round numbers restart in a requeued job,
        # and a peer's merge would gather them as this job's from a node that did not dump.
        remove_recovery_leftovers(memory_dir)

    def dump_if_useful(self, attempt: Attempt, cause: str, culprits: list[int],
                       iteration: int | None, data_parallel_size: int,
                       stop: threading.Event | None = None) -> Path | None:
        """Before the kill: the dump folder, or None (with one line when the failure could
        have had one but has no replicas to give it)."""
        dumped = DUMPED_CAUSES if self.round is None else DUMPED_ACROSS_NODES
        if cause not in dumped or iteration is None:
            return None  # nothing trained since the load, or a cause a relaunch will not cure
        if data_parallel_size < 2:
            self.fall_back(f"DP {data_parallel_size}: no shard has a replica")
        elif cause == "hang" and not culprits:
            self.fall_back("a hang with no known culprit: any rank may hold a half-done iteration")
        else:
            try:
                return self.dump(attempt, culprits, stop)
            except OSError as error:  # the memory tier gone or full: the checkpoint still serves
                self.fall_back(f"the dump could not be asked for: {error}")
        return None

    def dump(self, attempt: Attempt, culprits: Sequence[int] = (),
             stop: threading.Event | None = None) -> Path:
        """Ask every rank of ``attempt`` for its dump; returns the dump folder. The ranks on
        the ``culprits`` GPUs are not waited for: a hung rank is stopped, and a failed GPU's
        rank has no state worth a replica's place. Nor are any once ``stop`` is set
        (ftmaster's stop signal): no merge is then started (:meth:`start_merge`), and the
        caller removes the dumps after the attempt's kill, when no rank still writes one."""
        folder = (dump_folder(self.memory_dir, attempt.number) if self.round is None
                  else round_dump_folder(self.memory_dir, self.round[0]))
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        start = time.monotonic()
        runfiles.write_flag(request_flag_path(self.run_dir), folder=str(folder),
                            attempt=attempt.number)
        deadline = start + DUMP_TIMEOUT_S
        stop = stop or threading.Event()  # none: only the timeout ends the wait
        while (time.monotonic() < deadline and not self._all_answered(attempt, folder, culprits)
               and not stop.wait(0.02)):
            pass
        seconds, reports = time.monotonic() - start, read_reports(folder)
        dumped = [r for r in reports if r.refused is None]
        size = sum(r.bytes for r in dumped)
        self.event("replica_dump", ranks=sorted(r.rank for r in dumped), seconds=round(seconds, 4),
                   bytes=size, refused={str(r.rank): r.refused for r in reports if r.refused})
        log.info("replica recovery: %d rank(s) dumped their state in %.2f s (%.1f MB)",
                 len(dumped), seconds, size / 1e6)
        return folder

    def _all_answered(self, attempt: Attempt, folder: Path, culprits: Sequence[int]) -> bool:
        """Every rank but the culprits' has reported or ended (a dead one never will); its
        report is named after its global rank."""
        records, offset = attempt.ranks(), 0 if self.round is None else self.round[1]
        return all(report_path(folder, offset + local).exists() or gpu in culprits
                   or (local in records and records[local].exit_code is not None)
                   for local, gpu in enumerate(attempt.gpus))

    def start_merge(self, folder: Path, stop: threading.Event) -> "Merging | None":
        """Start the merge of ``folder``'s dumps; it needs only the reports, so it runs (and
        imports torch) while the old attempt is killed. None, after the fallback line, when
        the reports alone show there is no complete cut: no process need start to say so.
        None too once ``stop`` is set: the wait for the dumps ended on it, so a report
        missing is no lost shard, and no fallback is said. The caller then removes the dumps
        once no rank still writes one (after the kill)."""
        if stop.is_set():
            log.info("replica recovery: stopped by signal before the merge; no merge")
            return None
        try:
            choose_cut(read_reports(folder))
        except NoCut as refusal:
            self.fall_back(str(refusal))
            return None
        try:
            return self._merge_started(folder)
        except OSError as error:  # no process (ENOMEM, EAGAIN), no helper folder: not a traceback
            self.fall_back(f"the merge could not start: {error}")
            return None

    def _merge_started(self, folder: Path) -> "Merging":
        newest = read_tracker(self.save_dir)  # the merge reads the memory tier's itself
        module = ["-m", "megatron.training.replica_merge", str(folder), str(self.memory_dir),
                  *(["--newest", str(newest)] if newest is not None else [])]
        started = time.monotonic()
        helper = runfiles.ranks_dir(self.run_dir) / f"merge_{folder.name}"
        output = helper / "output.log"  # where run_module has the worker write
        # The worker appends to its output, and a folder's name may come back (across nodes
        # the round numbers restart in a requeued job): an earlier merge's line is no answer.
        output.unlink(missing_ok=True)
        warm = self.starter.run_module(module, helper) if self.starter is not None else None
        if warm is not None:
            return Merging(folder, warm, started, output)
        # Under the guard: killed with ftmaster, it went on writing into the memory tier
        process = subprocess.Popen(dying_with_this_process([sys.executable, *module]),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=naming_this_process(os.environ))
        return Merging(folder, process, started)

    def finish_merge(self, merging: "Merging", stop: threading.Event) -> int | None:
        """The merged checkpoint's iteration, or None after saying why there is none.
        Abandoned once ``stop`` is set (ftmaster's stop signal: every caller has one, as
        SLURM's SIGKILL comes long before the merge's timeout): the merge is killed and
        cleaned up as one past its timeout, so nothing half-built is left for a later
        launch to load."""
        said = besides = ""
        try:
            said, besides = merge_output(merging, stop)
            result = json.loads(said.strip().splitlines()[-1])
        except subprocess.TimeoutExpired as error:
            result = {"refused": f"the merge did not finish: {error}"}
        except (ValueError, IndexError) as error:
            result = {"refused": f"the merge said nothing readable ({error}); exit status "
                                 f"{merging.process.returncode}{_last_words(besides)}"}
        finally:
            shutil.rmtree(merging.folder, ignore_errors=True)  # the merged files are hard links
            remove_merge_leftovers(self.memory_dir)  # the merge has ended, killed or not
        if "refused" in result:
            self.fall_back(result["refused"])
            return None
        # seconds: the whole merge as recovery waits for it (cold: a fresh interpreter importing
        # torch, most of it, beside the kill of the old attempt); merge_seconds: its own work.
        seconds = time.monotonic() - merging.started
        self.event("replica_merge", iteration=result["iteration"], shards=result["shards"],
                   seconds=round(seconds, 4), merge_seconds=result["seconds"],
                   warm=merging.output is not None,
                   path=result["path"], bytes=result["bytes"])
        log.info("replica recovery: merged the checkpoint of iteration %d from %d shard(s) in "
                 "%.2f s: %s", result["iteration"], result["shards"], seconds, result["path"])
        return result["iteration"]

    def fall_back(self, reason: str) -> None:
        self.event("replica_fallback", reason=reason)
        log.warning("replica recovery: no complete cut (%s); falling back to the newest "
                    "checkpoint", reason)
