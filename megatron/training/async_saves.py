"""Asynchronous disk saves in flight, each with a deadline for its writers.

megatron-core's ``AsyncCallsQueue`` finalizes its saves in order and waits for a writer
without limit. A writer stuck on the file system (a hung NFS or Lustre server, a process
stopped) therefore left every later save started and never finalized, with nothing said, so
a relaunch fell back to the last checkpoint before it, and the end of training waited in
``close()`` until the collective timed out.

Here the oldest save in flight has a deadline, counted from its start or from when the one
before it ended, whichever is later: ``--async-save-timeout`` seconds, or by default the
longest of ten minutes, ten times the longest async save of this attempt written with no
other in flight, and the largest rank's share of a checkpoint at 10 MB/s (so that a first
save of a large model on a slow file system is given its time). Past it, every rank stops
that save's writers (one all-reduce decides, so all ranks part with the same save) and the
save fails as any failed save does: ``save_failed``, training goes on, and the saves behind
it are finalized as their writers finish. A persistent worker found dead fails its save at
the next agreed look (one found dead between saves is replaced before the next).

On CUDA the writer is one persistent worker per rank, which takes a save only once it has
written the one before: megatron-core's schedule then blocks training until it has (waiting
for the worker to stage the new save's tensors), and with a stuck worker for good. So there
a new save first finishes the one in flight, within the same deadline; a worker given up is
stopped, and the new save starts a fresh one.

A wait that blocks training (that one, and the end of training) writes no heartbeat, so under
ftmaster it has a shorter limit too: the supervisor takes a rank that shows no new iteration
and writes no checkpoint file for ``--hang-timeout`` for hung, and relaunches. Once such a
wait has lasted three quarters of that and the oldest save's folder has had no write for as
long, the save is given up as at its deadline (agreed alike), and training goes on or ends
with the saves behind it. A slow save that still writes is waited for, as the supervisor does.
Only each node's first rank looks at the folder (its file system's metadata server would
otherwise answer every rank), at most every few seconds and off the training thread (on a
file system that stopped answering a look may never return: no answer counts as a write when
the looks stopped answering, as the supervisor counts it, so the silence ends the wait once it
has lasted as long),
and the save is given up only when no node's look saw a write (a node-local ``--save`` holds
each node's own files).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from ftmaster.monitor.backends.bounded import CallTimeout, Worker

DEADLINE_FLOOR_S = 600.0
DEADLINE_FACTOR = 10.0
STUCK_BYTES_S = 10e6
"""A writer slower than this is taken for stuck (a file system's worst pace is far above)."""
POLL_S = 0.05
"""How often a blocking finalize looks at the writers again."""
CHECK_EVERY = 10
"""The deadline is agreed at every 10th look while a save is in flight (an all-reduce, 0.2 ms
on CPU gloo: per iteration it would double megatron-core's own check's cost)."""

BLOCKED_SHARE_OF_HANG = 0.75
"""The share of the supervisor's ``--hang-timeout`` a blocking wait lasts, with the oldest
save's writers writing nothing, before that save is given up: the rest is left for the saves
behind it and for training's next heartbeat. Not less: a writer's last ``fsync`` changes no
file's time either, and the supervisor waits the whole timeout for it."""

LOOK_EVERY_S = 5.0
"""Least time between two looks at a save's folder during a long blocking wait."""
LOOK_WAIT_S = 2.0
"""How long a look may take before it counts as a write when the looks stopped answering."""

Abandon = Callable[[object, str], None]
"""Told every save given up, with the reason (on every rank)."""
WrittenAt = Callable[[object], float | None]
"""When a save's folder last had a file written (unix time), None when unknown."""


class _FolderLooks:
    """When a save's folder last had a file written, looked at on a daemon worker (a look
    stuck on a file system holds up neither training nor the deadline's agreement for more
    than ``LOOK_WAIT_S``, and no second look queues behind it), at most every
    ``LOOK_EVERY_S``."""

    def __init__(self, written_at: "WrittenAt") -> None:
        self._written_at = written_at
        self._worker = Worker("async-save-folder-look")
        self._looked_at = -math.inf
        self._answer: tuple[object, float | None] | None = None
        self._unanswered_since: float | None = None
        """Unix time since which the looks have had no answer in time."""

    def last_write(self, save) -> float | None:
        """Unix time of the folder's last write; None when unknown (unreadable). A look with
        no answer in time counts as a write when the looks stopped answering: a parallel file
        system loaded by the save's own writes lists its folder slowly, and a save still
        writing was given up as idle; one that stopped answering still is, once that lasts."""
        answer = self._answer
        if answer is not None and answer[0] is save and \
                time.perf_counter() - self._looked_at < LOOK_EVERY_S:
            return answer[1]
        self._looked_at = time.perf_counter()
        try:
            self._answer = (save, self._worker.call(LOOK_WAIT_S, self._written_at, save))
        except CallTimeout:
            if self._unanswered_since is None:
                self._unanswered_since = time.time()
            self._answer = (save, self._unanswered_since)
        else:
            self._unanswered_since = None
        return self._answer[1]


@dataclass
class _InFlight:
    save: object
    started: float
    """perf_counter once scheduled."""
    alone: bool
    """Nothing else was in flight: its time, once done, is a writer's own (a save queued behind
    a stuck one is finalized only once that one is given up)."""


class AsyncSaves:
    """One rank's async saves in flight, in the order they were started (every rank starts
    and finalizes the same saves, so every rank's queue is the same)."""

    def __init__(self, queue: AsyncCallsQueue, group, timeout_s: float | None,
                 abandon: Abandon, rank_bytes: int = 0, hang_timeout_s: float | None = None,
                 written_at: WrittenAt | None = None) -> None:
        """``rank_bytes``: about what this rank writes at each save; the deadline takes the
        largest rank's (one all-reduce here), so that every rank tells the same deadline.
        ``hang_timeout_s``: the supervisor's, when one watches this rank; ``written_at`` tells
        how recently a save's writers wrote, given on the node's first rank only (looked at
        only once a blocking wait is long)."""
        self.queue = queue
        self._group = group
        self._timeout_s = timeout_s
        self._abandon = abandon
        self._hang_timeout_s = hang_timeout_s
        self._looks_at_folders = _FolderLooks(written_at) if written_at is not None else None
        largest = torch.tensor([float(rank_bytes)], dtype=torch.float64)
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=group)
        self._rank_bytes = largest.item()
        self._looks = 0
        """Looks at unfinished writers so far: the same count on every rank, as every rank
        looks at the same saves in the same order."""
        self._in_flight: deque[_InFlight] = deque()
        self._head_since = 0.0
        """When the oldest save in flight became the oldest: its deadline runs from then or
        from its start, whichever is later."""
        self._longest_s = 0.0

    def deadline_s(self) -> float:
        if self._timeout_s is not None:
            return self._timeout_s
        return max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * self._longest_s,
                   self._rank_bytes / STUCK_BYTES_S)

    def start(self, save, request) -> None:
        if self.queue.persistent:
            self.finalize(blocking=True)
            self._drop_dead_worker()
        self.queue.schedule_async_request(request)
        self._in_flight.append(_InFlight(save, time.perf_counter(), not self._in_flight))

    def ended(self, save, complete: bool) -> None:
        """``save``'s agreement ran (every async save's does, in order)."""
        if not self._in_flight or self._in_flight[0].save is not save:
            return
        done = self._pop_oldest()
        if complete and done.alone:
            self._longest_s = max(self._longest_s, time.perf_counter() - done.started)

    def finalize(self, blocking: bool) -> None:
        """Finish the saves whose writers are done on every rank, in order; give up the
        oldest once past its deadline. ``blocking``: until none is left. All ranks call it."""
        blocked_since = time.perf_counter() if blocking else None
        while self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False)
            if not self.queue.get_num_unfinalized_calls():
                return
            self._looks += 1
            given_up = self._why_give_up(blocked_since) if self._looks % CHECK_EVERY == 0 else None
            if given_up is not None:
                self._abandon_oldest(given_up)
            elif not blocking:
                return
            else:
                time.sleep(POLL_S)

    def close(self) -> None:
        """Every save finished or given up, then megatron-core's queue closed (all ranks)."""
        self.finalize(blocking=True)
        self._drop_dead_worker()
        self.queue.close()

    def _drop_dead_worker(self) -> None:
        """With nothing in flight, a dead persistent worker is let go of (no collective: each
        rank's is its own): megatron-core would hand it the next save and wait for it to
        stage the tensors, or at ``close()`` to say it is done, for good."""
        if self._worker_died():
            self.queue.persistent_caller.close(abort=True)
            self.queue.persistent_caller = None

    def _pop_oldest(self) -> _InFlight:
        self._head_since = time.perf_counter()
        return self._in_flight.popleft()

    def _why_give_up(self, blocked_since: float | None) -> str | None:
        """Why every rank gives up the oldest save, agreed (some rank found it past the
        deadline, its persistent worker dead, or its writers idle through a long blocking
        wait), else None."""
        oldest = self._in_flight[0] if self._in_flight else None
        age = time.perf_counter() - max(oldest.started, self._head_since) if oldest else 0.0
        deadline = self.deadline_s()
        # Idle goes in negated: the maximum of -idle is the least idle any node's look saw.
        found = torch.tensor([age if age > deadline else 0.0, float(self._worker_died()),
                              deadline, -self._idle_while_blocked(oldest, blocked_since),
                              self._hang_timeout_s or 0.0], dtype=torch.float64)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=self._group)
        late, died, deadline, least_idle, hang_timeout = found.tolist()  # every rank's the same
        idle = -least_idle if math.isfinite(least_idle) else 0.0  # -inf: no rank looked
        if died:
            return "its writer process died (the OOM killer?) before it finished: stopped"
        if late:
            return (f"its writers had not finished after {late:.1f} s, past the async save "
                    f"deadline of {deadline:g} s (--async-save-timeout; a file system that "
                    f"stopped answering?): stopped")
        if idle:
            return (f"training waited for its writers, which wrote nothing for {idle:.1f} s, "
                    f"{BLOCKED_SHARE_OF_HANG:.0%} of ftmaster's --hang-timeout of "
                    f"{hang_timeout:g} s (a file system that stopped answering?): "
                    f"stopped before the wait was taken for a hang")
        return None

    def _idle_while_blocked(self, oldest: _InFlight | None, blocked_since: float | None) -> float:
        """How long the oldest save's writers have written nothing as this node sees it,
        when that and the blocking wait both reach their share of the hang timeout, else 0;
        infinite on a rank that does not look (every look is some node's first rank's). The
        folder is looked at only then."""
        if self._looks_at_folders is None:
            return math.inf
        if oldest is None or blocked_since is None or self._hang_timeout_s is None:
            return 0.0
        limit = BLOCKED_SHARE_OF_HANG * self._hang_timeout_s
        waited = time.perf_counter() - blocked_since
        if waited < limit:
            return 0.0
        written = self._looks_at_folders.last_write(oldest.save)
        idle = waited if written is None else min(waited, time.time() - written)
        return idle if idle >= limit else 0.0

    def _worker_died(self) -> bool:
        """On CUDA, whether megatron-core's persistent worker is gone: it would never say the
        save is done (a forked writer that died is done, and its save fails at finalize)."""
        worker = self.queue.persistent_caller if self.queue.persistent else None
        return worker is not None and worker.process is not None and not worker.process.is_alive()

    def _abandon_oldest(self, reason: str) -> None:
        oldest = self.queue.async_calls.popleft()
        oldest.async_caller.close(abort=True)
        if self.queue.persistent:
            self.queue.persistent_caller = None  # the next save starts a fresh worker
        self._abandon(self._pop_oldest().save, reason)
