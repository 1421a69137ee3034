"""Health evidence per GPU, and the pure rule that says a GPU must not be planned on again.

Two answers, kept apart on purpose:

- an **alert** (:mod:`ftmaster.monitor.alerts`) asks for an emergency save *now*: the GPU
  may be about to fail, and a soft signal can be wrong, so it re-arms and may clear;
- **unschedulable** (:func:`unschedulable_reason`) says the GPU needs a reset or replacement
  before anything runs on it again: the supervisor never plans on it for the rest of the
  job. The monitor only reports the evidence (:class:`GpuEvidence`,
  :meth:`ftmaster.monitor.daemon.Monitor.unschedulable_gpus`); the supervisor decides.

Evidence only counts what was seen: a read that failed adds nothing (unknown is never
healthy, but it is not proof of a fault either). XIDs, double-bit errors and driver
conditions are sticky: nothing the monitor reads can show that the GPU was reset. Only a
``recover`` injection (the rehearsal's reset) clears a GPU's evidence. The recovery action
is the latest known value, since the driver clears it itself once the action was taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from ftmaster.monitor.sample import GpuSample
from ftmaster.monitor.signals import (RECOVERY_ACTION_NONE, double_bit_error, remember_counters,
                                      xid_severity)

# Driver conditions, most severe first (see the backends' ``conditions``).
CONDITIONS = ("gpu_is_lost", "wedged", "reset_required", "row_remap_failure")

# NVIDIA's XID catalogue: each of these asks for a GPU reset (or replacement) before reuse.
DEFAULT_UNSCHEDULABLE_XIDS = frozenset({
    48,   # double-bit ECC error
    62,   # internal micro-controller halt
    63,   # ECC page retirement / row remapping recorded: applied at the next reset
    64,   # row-remapper failure
    74,   # NVLink error
    79,   # fallen off the bus
    92,   # high single-bit ECC error rate
    94,   # contained ECC error
    95,   # uncontained ECC error
    119,  # GSP RPC timeout
    120,  # GSP error
    140,  # unrecovered ECC error
})


@dataclass(frozen=True)
class HealthConfig:
    unschedulable_xids: frozenset[int] = DEFAULT_UNSCHEDULABLE_XIDS
    """XIDs after which a GPU is never planned on again (each needs a reset or replacement).
    92 (a high single-bit ECC rate) is a judgement call: remove it to keep using such GPUs
    until they show something worse. Application XIDs (13, 31, 43, 45) do not belong here:
    they blame the program, not the GPU."""

    def __post_init__(self) -> None:
        codes = frozenset(self.unschedulable_xids)
        if not all(isinstance(c, int) and c >= 1 for c in codes):
            raise ValueError(f"unschedulable XIDs must be XID numbers >= 1, got {sorted(codes, key=str)}")
        object.__setattr__(self, "unschedulable_xids", codes)


@dataclass(frozen=True)
class GpuEvidence:
    """What the monitor has seen of one GPU's health."""

    xids: frozenset[int] = frozenset()
    """Every XID seen (an event: the driver reports it once)."""
    double_bit_error: bool = False
    """An uncorrectable-error counter rose while the monitor watched."""
    recovery_action: int | None = None
    """The driver's latest known recovery action (0 none); None: never read."""
    conditions: frozenset[str] = frozenset()
    """Driver conditions seen: gpu_is_lost, wedged, reset_required, row_remap_failure."""
    levels: Mapping[str, int] = field(default_factory=dict)
    """Error counters at their last known values, to tell a new error from an old one."""


def observe_sample(evidence: GpuEvidence, sample: GpuSample) -> GpuEvidence:
    """``evidence`` updated with one sample of its GPU; unknown fields change nothing."""
    levels = dict(evidence.levels)
    rose = double_bit_error(levels, sample)
    remember_counters(levels, sample)
    return replace(
        evidence,
        xids=evidence.xids if sample.xid is None else evidence.xids | {sample.xid},
        double_bit_error=evidence.double_bit_error or rose,
        recovery_action=evidence.recovery_action if sample.recovery_action is None else sample.recovery_action,
        levels=levels,
    )


def observe_conditions(evidence: GpuEvidence, conditions: Iterable[str]) -> GpuEvidence:
    """``evidence`` with the driver ``conditions`` of one sample added."""
    added = frozenset(conditions) - evidence.conditions
    return replace(evidence, conditions=evidence.conditions | added) if added else evidence


def unschedulable_reason(evidence: GpuEvidence, config: HealthConfig) -> str | None:
    """Why the GPU must not be planned on again, or None. The first that applies of: a driver
    condition (``gpu_is_lost``, ``wedged``, ``reset_required``, ``row_remap_failure``),
    ``ecc_dbe``, ``xid_N`` (the most severe configured XID seen), ``recovery_action_N``."""
    for condition in CONDITIONS:
        if condition in evidence.conditions:
            return condition
    if evidence.double_bit_error:
        return "ecc_dbe"
    critical = evidence.xids & config.unschedulable_xids
    if critical:
        return f"xid_{min(critical, key=lambda code: (xid_severity(code), code))}"
    action = evidence.recovery_action
    if action is not None and action != RECOVERY_ACTION_NONE:
        return f"recovery_action_{action}"
    return None
