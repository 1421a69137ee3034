"""Fault injection specs: ``KIND:gpu=G,at=iter:K`` or ``KIND:gpu=G,at=Ns``.

The same spec drives the simulated telemetry (the monitor's anomaly overlay and backends) and
the launcher (which kills or stops the rank on that GPU):

- ``degrade``: the GPU's telemetry worsens until the monitor alerts;
- ``fail``: the rank on that GPU is killed and the GPU is marked lost;
- ``hang``: the rank on that GPU is stopped (its GPU goes idle);
- ``recover``: a lost or wedged GPU comes back, its XIDs and wedge forgotten (as after a
  reset), under ``--policy wait`` where lost GPUs are waited for; a GPU already retired as
  unschedulable stays retired;
- ``xid`` (``xid:gpu=G,code=N,at=...``, the only kind with ``code``): the telemetry shows XID
  N on the GPU; the launcher kills its rank as a CUDA error would, and ranks started on it
  fail at start-up until a ``recover``;
- ``wedge``: every telemetry read of the GPU blocks, as in a wedged driver, until a
  ``recover``; the monitor reports it lost (``wedged``) while it keeps sampling the others;
- ``nan`` (``at=iter:K`` only, K >= 1): the loss and gradients of the rank on that GPU become
  NaN at that iteration (training's business: the telemetry is unaffected); an attempt that
  resumed past it never trains it, and the run's end says it never fired;
- ``slow`` (``slow:gpu=G,factor=F,at=...``, the only kind with ``factor``): from then on the
  rank on that GPU computes F times slower (the trainer sleeps F - 1 times each iteration's
  compute before the gradient reduction), a straggler for the others to wait for; it lasts
  for the attempt (the telemetry is unaffected).

``at=iter:K`` fires once the training iteration (from the heartbeat) reaches K;
``at=Ns`` fires N seconds after the monitor (or launcher) started. Under ``ftmaster launch``
an injection may also wait for an event, ``after=EVENT`` (e.g.
``fail:gpu=1,at=iter:12,after=emergency_save``): it fires once its ``at=`` is reached *and*
the run has recorded that event since ftmaster started. A rehearsal then tests the chain it
means to test (alert, emergency save, failure) whatever the machine's speed, instead of racing
the monitor against training.
"""

from __future__ import annotations

import enum
import math
import signal
from dataclasses import dataclass, replace

CUDA_ERROR_ENV = "FTMASTER_INJECT_CUDA_ERROR"
"""``LOCAL_RANK:XID[,...]`` (set, if empty, in every rehearsal): the ranks that fail at start-up
with the CUDA error of that XID; its presence arms the others' handler for one sent later."""
CUDA_ERROR_SIGNAL = signal.SIGUSR2
"""What brings a rank the CUDA error of an XID injected while it runs (its handler raises)."""


class Fault(enum.Enum):
    DEGRADE = "degrade"
    FAIL = "fail"
    HANG = "hang"
    RECOVER = "recover"
    XID = "xid"
    WEDGE = "wedge"
    NAN = "nan"
    SLOW = "slow"


KINDS = ", ".join(kind.value for kind in Fault)
TRAINING_FAULTS = (Fault.NAN, Fault.SLOW)
"""Faults a training rank plays out (its loss, its compute): only ftmaster launch runs one."""
TELEMETRY_KINDS = ", ".join(kind.value for kind in Fault if kind not in TRAINING_FAULTS)
# The events an injection may wait for: what a rehearsal's chain of cause and effect passes
# through (DESIGN's event contract).
AFTER_EVENTS = ("risk_alert", "checkpoint_request", "emergency_save", "periodic_save",
                "persisted", "checkpoint_loaded", "resumed", "warm_ready")
MAX_SLOW_FACTOR = 1000.0
"""The most a ``slow`` slows a rank by: beyond, its iterations outlast any hang timeout (a
``hang``'s business), and the trainer's sleep overflows (``time.sleep`` refuses 1e300 s)."""
GRAMMAR = (f"KIND:gpu=G,at=iter:K or KIND:gpu=G,at=Ns, optionally ,after=EVENT (KIND: {KINDS}; "
           f"xid also needs code=N, e.g. xid:gpu=1,code=79,at=iter:8; slow needs factor=F "
           f"above 1 (at most {MAX_SLOW_FACTOR:g}), e.g. slow:gpu=1,factor=2,at=iter:8; nan takes "
           f"no after=; EVENT: "
           f"{', '.join(AFTER_EVENTS)})")


@dataclass(frozen=True)
class Injection:
    """One scheduled fault; exactly one of ``at_iteration`` and ``at_seconds`` is set,
    ``code`` (the XID number) is set exactly for ``xid`` and ``factor`` for ``slow``."""

    kind: Fault
    gpu: int
    at_iteration: int | None = None
    at_seconds: float | None = None
    code: int | None = None
    after: str | None = None
    """An event (one of ``AFTER_EVENTS``) the run must have recorded before the fault fires."""
    factor: float | None = None
    """How many times slower the rank computes (``slow``)."""

    def __post_init__(self) -> None:
        if self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")
        if (self.at_iteration is None) == (self.at_seconds is None):
            raise ValueError("an injection needs exactly one of at=iter:K and at=Ns")
        if self.at_iteration is not None and self.at_iteration < 0:
            raise ValueError(f"at=iter:K needs K >= 0, got {self.at_iteration}")
        if self.at_seconds is not None and not (self.at_seconds >= 0 and math.isfinite(self.at_seconds)):
            raise ValueError(f"at=Ns needs a finite N >= 0, got {self.at_seconds}")
        if self.kind is Fault.XID and (self.code is None or self.code < 1):
            raise ValueError(f"an xid injection needs code=N with an XID number N >= 1, got {self.code}")
        if self.kind is not Fault.XID and self.code is not None:
            raise ValueError(f"code= is only for xid, not {self.kind.value}")
        if (self.kind is Fault.SLOW) != (self.factor is not None):
            raise ValueError("factor= is for slow, which needs it")
        if self.factor is not None and not 1 < self.factor <= MAX_SLOW_FACTOR:
            raise ValueError(f"factor must be a number above 1 and at most {MAX_SLOW_FACTOR:g}, "
                             f"got {self.factor}")
        if self.after is not None and self.after not in AFTER_EVENTS:
            raise ValueError(f"after= takes one of {', '.join(AFTER_EVENTS)}, got {self.after!r}")
        if self.after is not None and self.kind is Fault.NAN:
            raise ValueError("nan cannot wait for an event: it is handed to the next attempt")

    def due(self, iteration: int | None, elapsed_s: float,
            seen_events: frozenset[str] = frozenset()) -> bool:
        """Whether the trigger has been reached (and the awaited event seen); an unknown
        iteration never triggers iter:K."""
        if self.after is not None and self.after not in seen_events:
            return False
        if self.at_iteration is not None:
            return iteration is not None and iteration >= self.at_iteration
        return elapsed_s >= self.at_seconds

    def at_once(self) -> Injection:
        """The same fault, due at once: how the launcher hands a fired fault to the monitor."""
        return replace(self, at_iteration=None, at_seconds=0.0, after=None)

    def __str__(self) -> str:
        at = f"iter:{self.at_iteration}" if self.at_iteration is not None else f"{self.at_seconds:g}s"
        code = ("" if self.code is None else f",code={self.code}") + (
            "" if self.factor is None else f",factor={self.factor:g}")
        after = "" if self.after is None else f",after={self.after}"
        return f"{self.kind.value}:gpu={self.gpu}{code},at={at}{after}"


def parse_injection(spec: str) -> Injection:
    """Parse one ``--inject`` value; a bad spec raises ValueError naming the problem."""
    kind_text, sep, rest = spec.strip().partition(":")
    if not sep:
        raise ValueError(f"bad --inject {spec!r}: expected {GRAMMAR}")
    try:
        kind = Fault(kind_text.strip().lower())
    except ValueError:
        raise ValueError(f"bad --inject {spec!r}: unknown kind {kind_text!r}; expected {GRAMMAR}") from None
    fields = _parse_fields(spec, rest, kind)
    gpu = _parse_gpu(spec, fields["gpu"])
    at_iteration, at_seconds = _parse_at(spec, fields["at"])
    if kind is Fault.NAN and at_iteration is None:  # the trainer poisons a given iteration
        raise ValueError(f"bad --inject {spec!r}: nan needs at=iter:K (an iteration, not a time)")
    if kind is Fault.NAN and at_iteration == 0:  # armed, it never fired and nothing said so
        raise ValueError(f"bad --inject {spec!r}: nan needs at=iter:K with K >= 1 (iterations "
                         "count from 1)")
    code = _parse_code(spec, fields["code"]) if kind is Fault.XID else None
    factor = _parse_factor(spec, fields["factor"]) if kind is Fault.SLOW else None
    after = fields.get("after")
    if after is not None and after.lower() not in AFTER_EVENTS:
        raise ValueError(f"bad --inject {spec!r}: after= takes an event, one of "
                         f"{', '.join(AFTER_EVENTS)}; got {after!r}")
    if after is not None and kind is Fault.NAN:
        raise ValueError(f"bad --inject {spec!r}: nan cannot take after= (it is handed to the "
                         f"next attempt at its launch)")
    return Injection(kind, gpu, at_iteration=at_iteration, at_seconds=at_seconds, code=code,
                     after=None if after is None else after.lower(), factor=factor)


_OWN_FIELDS = {Fault.XID: "code", Fault.SLOW: "factor"}
"""The field only one kind takes, and needs."""


def _parse_fields(spec: str, rest: str, kind: Fault) -> dict[str, str]:
    own = _OWN_FIELDS.get(kind)
    required = ("gpu", own, "at") if own else ("gpu", "at")
    allowed = (*required, "after")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or not value.strip():
            raise ValueError(f"bad --inject {spec!r}: {part!r} is not key=value; expected {GRAMMAR}")
        for other, field in _OWN_FIELDS.items():
            if key == field and kind is not other:
                raise ValueError(f"bad --inject {spec!r}: {field}= is only for {other.value}")
        if key not in allowed:
            raise ValueError(f"bad --inject {spec!r}: unknown field {key!r}; expected {GRAMMAR}")
        if key in fields:
            raise ValueError(f"bad --inject {spec!r}: {key!r} given twice")
        fields[key] = value.strip()
    for name in required:
        if name not in fields:
            example = {"code": " (the XID number, e.g. code=79)",
                       "factor": " (how many times slower, e.g. factor=2)"}.get(name, "")
            raise ValueError(f"bad --inject {spec!r}: missing {name}={example}; expected {GRAMMAR}")
    return fields


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number of at most 18 ASCII digits (``str.isdigit`` takes "²", and
    ``int`` refuses 5000 digits in words of its own), else None."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _parse_code(spec: str, text: str) -> int:
    code = _whole_number(text)
    if code is None or code < 1:
        raise ValueError(f"bad --inject {spec!r}: code must be an XID number like code=79, got {text!r}")
    return code


def _parse_factor(spec: str, text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = math.nan
    if not 1 < factor <= MAX_SLOW_FACTOR:
        raise ValueError(f"bad --inject {spec!r}: factor must be a number above 1 and at most "
                         f"{MAX_SLOW_FACTOR:g}, like factor=2, got {text!r}")
    return factor


def _parse_gpu(spec: str, text: str) -> int:
    gpu = _whole_number(text)
    if gpu is None:
        raise ValueError(f"bad --inject {spec!r}: gpu must be a GPU index like gpu=0, got {text!r}")
    return gpu


def _parse_at(spec: str, text: str) -> tuple[int | None, float | None]:
    lowered = text.lower()
    if lowered.startswith("iter:"):
        number = _whole_number(lowered[len("iter:"):])
        if number is None:
            raise ValueError(f"bad --inject {spec!r}: at=iter:K needs a whole K >= 0, got {text!r}")
        return number, None
    if lowered.endswith("s"):
        try:
            seconds = float(lowered[:-1])
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and seconds >= 0:
            return None, seconds
    raise ValueError(f"bad --inject {spec!r}: at= must be iter:K or Ns (e.g. at=iter:20, at=30s), "
                     f"got {text!r}")
