"""When a score becomes an alert: threshold, hysteresis and cooldown, per GPU.

A GPU alerts when its score reaches the threshold while it is armed and its cooldown has
passed. Alerting disarms it; it re-arms once its score falls below ``threshold -
rearm_margin`` (or half the threshold, if lower). A hard reason that this GPU has not alerted on since it last re-armed
(a new XID, a double-bit error after a thermal alert, the device disappearing) alerts at
once, whatever the cooldown: those are the alerts a checkpoint request cannot wait for. A
sample of which nothing was read (``telemetry_unknown``) neither alerts nor re-arms: unknown
is not healthy, nor is it risk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftmaster.monitor.scorers import Assessment


@dataclass(frozen=True)
class AlertConfig:
    threshold: float = 0.95
    """Score at or above which a GPU alerts (the paper's 0.95)."""
    cooldown_s: float = 300.0
    """Least time between two soft alerts of one GPU, in the samples' own clock."""
    rearm_margin: float = 0.2
    """How far below the threshold a score must fall before the GPU can alert again."""

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"risk threshold must be in (0, 1], got {self.threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown must be >= 0 s, got {self.cooldown_s}")
        if not 0.0 <= self.rearm_margin < 1.0:
            raise ValueError(f"re-arm margin must be in [0, 1), got {self.rearm_margin}")


@dataclass
class _GpuAlertState:
    armed: bool = True
    last_alert: float | None = None
    hard_reported: set[str] = field(default_factory=set)


class AlertPolicy:
    def __init__(self, config: AlertConfig | None = None) -> None:
        self.config = config or AlertConfig()
        self._gpus: dict[int, _GpuAlertState] = {}

    def forget(self, gpu: int) -> None:
        self._gpus.pop(gpu, None)

    def still_alerting(self, gpu: int) -> bool:
        """Whether ``gpu`` alerted and its score has not yet fallen to the re-arm level."""
        state = self._gpus.get(gpu)
        return state is not None and not state.armed

    def decide(self, gpu: int, time_s: float, assessment: Assessment) -> bool:
        """Whether this assessment is an alert; updates the GPU's arming state. A sample of
        which nothing was read is neither: its 0.5 re-armed a GPU that had alerted (a dying
        GPU's reads fail), and at a threshold of 0.5 or less it alerted on no data."""
        if assessment.unknown:
            return False
        cfg = self.config
        state = self._gpus.setdefault(gpu, _GpuAlertState())
        # The margin never takes the re-arm level below half the threshold (low thresholds).
        if not state.armed and assessment.score < cfg.threshold - min(cfg.rearm_margin, cfg.threshold / 2):
            state.armed = True
            state.hard_reported.clear()
        new_hard = set(assessment.hard_reasons) - state.hard_reported
        # A wall clock stepped back (NTP, a VM resumed) before the last alert cools it: its
        # alerts were held back until the clock caught up
        cooled = state.last_alert is None or not 0 <= time_s - state.last_alert < cfg.cooldown_s
        soft_alert = assessment.score >= cfg.threshold and state.armed and cooled
        if not (soft_alert or new_hard):
            return False
        state.armed = False
        state.last_alert = time_s
        state.hard_reported |= set(assessment.hard_reasons)
        return True
