"""Fault injection specs: ``KIND:gpu=G,at=iter:K`` or ``KIND:gpu=G,at=Ns``.

The same spec drives the simulated telemetry (the monitor's anomaly overlay) and the
launcher (which kills or stops the rank on that GPU):

- ``degrade``: the GPU's telemetry worsens until the monitor alerts;
- ``fail``: the rank on that GPU is killed and the GPU is marked lost;
- ``hang``: the rank on that GPU is stopped (its GPU goes idle);
- ``recover``: a lost GPU comes back.

``at=iter:K`` fires once the training iteration (from the heartbeat) reaches K;
``at=Ns`` fires N seconds after the monitor (or launcher) started.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Fault(enum.Enum):
    DEGRADE = "degrade"
    FAIL = "fail"
    HANG = "hang"
    RECOVER = "recover"


GRAMMAR = "KIND:gpu=G,at=iter:K or KIND:gpu=G,at=Ns (KIND: degrade, fail, hang, recover)"


@dataclass(frozen=True)
class Injection:
    """One scheduled fault; exactly one of ``at_iteration`` and ``at_seconds`` is set."""

    kind: Fault
    gpu: int
    at_iteration: int | None = None
    at_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")
        if (self.at_iteration is None) == (self.at_seconds is None):
            raise ValueError("an injection needs exactly one of at=iter:K and at=Ns")
        if self.at_iteration is not None and self.at_iteration < 0:
            raise ValueError(f"at=iter:K needs K >= 0, got {self.at_iteration}")
        if self.at_seconds is not None and not (self.at_seconds >= 0 and math.isfinite(self.at_seconds)):
            raise ValueError(f"at=Ns needs a finite N >= 0, got {self.at_seconds}")

    def due(self, iteration: int | None, elapsed_s: float) -> bool:
        """Whether the trigger has been reached; an unknown iteration never triggers iter:K."""
        if self.at_iteration is not None:
            return iteration is not None and iteration >= self.at_iteration
        return elapsed_s >= self.at_seconds

    def __str__(self) -> str:
        at = f"iter:{self.at_iteration}" if self.at_iteration is not None else f"{self.at_seconds:g}s"
        return f"{self.kind.value}:gpu={self.gpu},at={at}"


def parse_injection(spec: str) -> Injection:
    """Parse one ``--inject`` value; a bad spec raises ValueError naming the problem."""
    kind_text, sep, rest = spec.strip().partition(":")
    if not sep:
        raise ValueError(f"bad --inject {spec!r}: expected {GRAMMAR}")
    try:
        kind = Fault(kind_text.strip().lower())
    except ValueError:
        raise ValueError(f"bad --inject {spec!r}: unknown kind {kind_text!r}; expected {GRAMMAR}") from None
    fields = _parse_fields(spec, rest)
    gpu = _parse_gpu(spec, fields.get("gpu"))
    at_iteration, at_seconds = _parse_at(spec, fields.get("at"))
    return Injection(kind, gpu, at_iteration=at_iteration, at_seconds=at_seconds)


def _parse_fields(spec: str, rest: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or not value.strip():
            raise ValueError(f"bad --inject {spec!r}: {part!r} is not key=value; expected {GRAMMAR}")
        if key not in ("gpu", "at"):
            raise ValueError(f"bad --inject {spec!r}: unknown field {key!r}; expected {GRAMMAR}")
        if key in fields:
            raise ValueError(f"bad --inject {spec!r}: {key!r} given twice")
        fields[key] = value.strip()
    for required in ("gpu", "at"):
        if required not in fields:
            raise ValueError(f"bad --inject {spec!r}: missing {required}=; expected {GRAMMAR}")
    return fields


def _parse_gpu(spec: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"bad --inject {spec!r}: gpu must be a GPU index like gpu=0, got {text!r}")
    return int(text)


def _parse_at(spec: str, text: str) -> tuple[int | None, float | None]:
    lowered = text.lower()
    if lowered.startswith("iter:"):
        number = lowered[len("iter:"):]
        if not number.isdigit():
            raise ValueError(f"bad --inject {spec!r}: at=iter:K needs a whole K >= 0, got {text!r}")
        return int(number), None
    if lowered.endswith("s"):
        try:
            seconds = float(lowered[:-1])
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and seconds >= 0:
            return None, seconds
    raise ValueError(f"bad --inject {spec!r}: at= must be iter:K or Ns (e.g. at=iter:20, at=30s), "
                     f"got {text!r}")
