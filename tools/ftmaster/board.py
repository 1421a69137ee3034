"""ftmaster's own TensorBoard scalars, beside the trainer's (``--tensorboard-dir`` in the
training command): the risk per GPU and the recoveries, keyed by training iteration so they
line up with ``lm loss``.

They go to ``TENSORBOARD_DIR/ftmaster`` (``ftmaster_node<R>`` across nodes), a run of its
own in TensorBoard's list: ``ftmaster/risk/gpu<G>`` (per iteration per GPU, the highest of
its samples, written once the iteration is over),
``ftmaster/alerts`` and ``ftmaster/failures`` (running counts, at the iteration they came
at), ``ftmaster/rto_seconds`` and ``ftmaster/rpo_iterations`` (at the iteration a relaunch
resumed from, or one step past the last recovery's when that is not past it).

The iteration of the risk and the counts is the furthest the run reached, never one it
redoes: TensorBoard takes a step written again for a job restarted from a checkpoint and drops
every point at or after it, so a relaunch from an older checkpoint would drop the risk that
came before the failure. What is sampled while the run redoes iterations (or while nothing
trains) counts at the furthest one. For the same reason two recoveries never share a step (two
from one checkpoint would keep only the later, one from an older checkpoint would drop those
after it); the steps a recovery is moved to are not iterations the run reached.

Another launch on the folder (a SLURM requeue, a relaunch after ``gave_up``) writes a new event
file beside the earlier ones, and TensorBoard reads them as one run: its board continues where
they end, at the furthest iteration and with the counts they hold, the risk there a peak its
samples can only raise. A file it cannot read to the end counts for what it read.

They are never worth the run: the first write that fails (a full disk under the folder) is
said in one line, and the scalars stop there.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

from ftmaster.metrics import Recoveries
from ftmaster.recovery.megatron_args import flag_value
from ftmaster.scalar_writer import GuardedWriter

log = logging.getLogger("ftmaster")


RISK = "ftmaster/risk/gpu"
ALERTS = "ftmaster/alerts"
FAILURES = "ftmaster/failures"
RTO = "ftmaster/rto_seconds"
RPO = "ftmaster/rpo_iterations"
PER_RECOVERY = (RTO, RPO)
Point = tuple[int, float]  # (step, value)


def last_points(folder: Path) -> dict[str, Point]:
    """Each ftmaster tag's last point in the event files of ``folder``, read in
    TensorBoard's order (by file name): where its curve ends. A truncated tail (a launch
    killed mid-write) is left off, as TensorBoard leaves it."""
    last: dict[str, Point] = {}
    for path in sorted(folder.glob("*tfevents*")):
        try:
            for event in _events(path):
                for value in event.summary.value:
                    if value.tag.startswith("ftmaster/") and value.HasField("simple_value"):
                        last[value.tag] = (event.step, value.simple_value)
        except Exception as error:  # foreign bytes, or the file system's error: the run goes on
            log.warning("ftmaster's TensorBoard scalars: %s is unreadable past %s: %s",
                        path, type(error).__name__, error)
    return last


def _events(path: Path):
    """The events of a TFRecord file up to a truncated tail. Only each record's length is
    checked against its CRC, which keeps the framing honest: tensorboard's own reader checks
    every record's body too, in pure Python: 3.1 s against 0.9 s here for the 200,000 risk
    points of 25,000 iterations on 8 GPUs, read on the launch's way to its first attempt."""
    # imports tensorboard: only with a board
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data, at = path.read_bytes(), 0
    while at + 16 <= len(data):
        header = data[at:at + 8]
        if masked_crc32c(header) != struct.unpack_from("<I", data, at + 8)[0]:
            raise ValueError(f"the record at byte {at} has a damaged length")
        end = at + 12 + struct.unpack("<Q", header)[0]
        if end + 4 > len(data):
            return
        yield Event.FromString(data[at + 12:end])
        at = end + 4


def risk_peaks_at(points: dict[str, Point], iteration: int) -> dict[int, Point]:
    """The risk points among ``points`` at ``iteration``, by GPU: the peaks samples there raise."""
    peaks = {}
    for tag, point in points.items():
        gpu = tag.removeprefix(RISK)
        if tag.startswith(RISK) and gpu.isdigit() and point[0] == iteration:
            peaks[int(gpu)] = point
    return peaks


class RunBoard:
    def __init__(self, folder: Path, node_rank: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only here

        earlier, files_before = last_points(folder), set(folder.glob("*tfevents*"))
        self.writer = GuardedWriter.opened(lambda: SummaryWriter(log_dir=str(folder), flush_secs=10),
                                           f"ftmaster's TensorBoard scalars in {folder}", log.error,
                                           full_only=True)
        self._own_files = set(folder.glob("*tfevents*")) - files_before
        """The event file this board writes (made at once, by tensorboard)."""
        self.iteration = max((step for tag, (step, _) in earlier.items()
                              if tag not in PER_RECOVERY), default=0)
        """The furthest iteration the run reached (see the module docstring)."""
        self._recovery_step = max((earlier[tag][0] for tag in PER_RECOVERY if tag in earlier),
                                  default=-1)
        # GPU -> (iteration, its highest risk yet), written once a sample comes at another
        # iteration, or at close: the monitor's thread's alone until then
        self._risk_peak = risk_peaks_at(earlier, self.iteration)
        self._alerts = int(earlier.get(ALERTS, (0, 0))[1])
        self._failures = int(earlier.get(FAILURES, (0, 0))[1])
        self._recoveries = Recoveries(node_rank)

    @classmethod
    def for_command(cls, command: list[str], node_rank: int | None) -> RunBoard | None:
        """The board of a training command with ``--tensorboard-dir``; None without."""
        folder = cls.folder_for(command, node_rank)
        return None if folder is None else cls(folder, node_rank)

    @staticmethod
    def folder_for(command: list[str], node_rank: int | None) -> Path | None:
        """Where the board of a training command writes; None without ``--tensorboard-dir``."""
        folder = flag_value(command[1:], "--tensorboard-dir")
        if not folder:  # empty: no writer, as in Megatron-LM (Path("") is the working directory)
            return None
        return Path(folder) / ("ftmaster" if node_rank is None else f"ftmaster_node{node_rank}")

    def watch(self, monitor) -> None:
        monitor.sample_listeners.append(self.observe_samples)

    def observe_samples(self, samples, alerts) -> None:
        for sample in samples:
            if sample.failure_risk is None:
                continue
            at, peak = self._risk_peak.get(sample.gpu_id, (self.iteration, sample.failure_risk))
            if at != self.iteration:
                self._write_risk(sample.gpu_id, at, peak)
                at, peak = self.iteration, sample.failure_risk
            self._risk_peak[sample.gpu_id] = (at, max(peak, sample.failure_risk))
        for _ in alerts:
            self._alerts += 1
            self.writer.add_scalar(ALERTS, self._alerts, self.iteration)

    def _write_risk(self, gpu: int, iteration: int, risk: float) -> None:
        self.writer.add_scalar(f"{RISK}{gpu}", risk, iteration)

    def observe_heartbeat(self, heartbeat: dict | None) -> None:
        if heartbeat:
            self._reached(heartbeat["iteration"])

    def _reached(self, iteration: int) -> None:
        self.iteration = max(self.iteration, iteration)

    def observe_persisting(self, persisting: bool) -> None:
        """Nothing on the board depends on which node persists."""

    def observe_state(self, state) -> None:
        """Nothing: the state lives in the metrics."""

    def observe_event(self, event: dict) -> None:
        if event.get("event") == "failure":
            self._failures += 1
            if isinstance(event.get("iteration"), int):
                self._reached(event["iteration"])
            self.writer.add_scalar(FAILURES, self._failures, self.iteration)
        recovered = self._recoveries.observe(event)
        if recovered is not None:
            step = self._next_recovery_step(
                self.iteration if recovered.loaded is None else recovered.loaded)
            self.writer.add_scalar(RTO, recovered.rto_s, step)
            if recovered.lost_iterations is not None:
                self.writer.add_scalar(RPO, recovered.lost_iterations, step)
            self.writer.flush()

    def _next_recovery_step(self, resumed_from: int) -> int:
        """``resumed_from``, or one past the last recovery's step: TensorBoard keeps one point
        per step and drops those at or after a step written again (see the module docstring)."""
        self._recovery_step = max(resumed_from, self._recovery_step + 1)
        return self._recovery_step

    def close(self) -> None:
        # a copy: a monitor whose stop timed out may still add to it
        for gpu, (iteration, peak) in list(self._risk_peak.items()):
            self._write_risk(gpu, iteration, peak)
        self.writer.close()

    def withdraw(self) -> None:
        """For a refused launch: closed, and its event file removed. Kept, each refused
        launch left one more file in the board's folder with no scalar in it."""
        self.writer.close()
        for path in self._own_files:
            path.unlink(missing_ok=True)
