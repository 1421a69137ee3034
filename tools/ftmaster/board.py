"""ftmaster's own TensorBoard scalars, beside the trainer's (``--tensorboard-dir`` in the
training command): the risk per GPU and the recoveries, keyed by training iteration so they
line up with ``lm loss``.

They go to ``TENSORBOARD_DIR/ftmaster`` (``ftmaster_node<R>`` across nodes), a run of its
own in TensorBoard's list: ``ftmaster/risk/gpu<G>`` (once per iteration per GPU),
``ftmaster/alerts`` and ``ftmaster/failures`` (running counts, at the iteration they came
at), ``ftmaster/rto_seconds`` and ``ftmaster/rpo_iterations`` (at the iteration a relaunch
resumed from).

They are never worth the run: the first write that fails (a full disk under the folder) is
said in one line, and the scalars stop there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from ftmaster.metrics import Recoveries
from ftmaster.recovery.megatron_args import flag_value

log = logging.getLogger("ftmaster")


class RunBoard:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only here

        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder), flush_secs=10)
        self._stopped = False
        self.iteration = 0
        self._risk_written: dict[int, int] = {}  # GPU -> the last iteration written
        self._alerts = self._failures = 0
        self._recoveries = Recoveries()

    @classmethod
    def for_command(cls, command: list[str], node_rank: int | None) -> RunBoard | None:
        """The board of a training command with ``--tensorboard-dir``; None without."""
        folder = flag_value(command[1:], "--tensorboard-dir")
        if folder is None:
            return None
        return cls(Path(folder) / ("ftmaster" if node_rank is None else f"ftmaster_node{node_rank}"))

    def watch(self, monitor) -> None:
        monitor.sample_listeners.append(self.observe_samples)

    def observe_samples(self, samples, alerts) -> None:
        for sample in samples:
            if sample.failure_risk is not None and self._risk_written.get(sample.gpu_id) != self.iteration:
                self._risk_written[sample.gpu_id] = self.iteration
                self._write(lambda: self.writer.add_scalar(
                    f"ftmaster/risk/gpu{sample.gpu_id}", sample.failure_risk, self.iteration))
        for _ in alerts:
            self._alerts += 1
            self._write(lambda: self.writer.add_scalar("ftmaster/alerts", self._alerts,
                                                       self.iteration))

    def observe_heartbeat(self, heartbeat: dict | None) -> None:
        if heartbeat:
            self.iteration = heartbeat["iteration"]

    def observe_state(self, state) -> None:
        """Nothing: the state lives in the metrics."""

    def observe_event(self, event: dict) -> None:
        if event.get("event") == "failure":
            self._failures += 1
            iteration = event.get("iteration")
            at = iteration if isinstance(iteration, int) else self.iteration
            self._write(lambda: self.writer.add_scalar("ftmaster/failures", self._failures, at))
        recovered = self._recoveries.observe(event)
        if recovered is not None:
            at = self.iteration if recovered.loaded is None else recovered.loaded
            self._write(lambda: self.writer.add_scalar("ftmaster/rto_seconds", recovered.rto_s, at))
            if recovered.lost_iterations is not None:
                self._write(lambda: self.writer.add_scalar("ftmaster/rpo_iterations",
                                                           recovered.lost_iterations, at))
            self._write(self.writer.flush)

    def close(self) -> None:
        self._write(self.writer.close)
        self._stopped = True

    def _write(self, write: Callable[[], object]) -> None:
        """One call on the writer, unless the scalars stopped. tensorboard writes from a thread
        of its own, and once a write of it fails every later call raises that error again:
        out of the monitor's step (which then skipped its lost GPUs) and out of the
        supervisor (which ended the run), for a full disk under the folder."""
        if self._stopped:
            return
        try:
            write()
        except Exception as error:  # whatever the file system raised: the run goes on
            self._stopped = True
            log.error("ftmaster's TensorBoard scalars in %s stop here: %s: %s", self.folder,
                      type(error).__name__, error)
