"""Telemetry backends: each ``sample()`` returns one :class:`GpuSample` per present GPU.

The contract every backend keeps:

- a GPU that is present but whose read failed comes back with ``None`` fields (unknown);
- a GPU that is gone (NVML says lost, a read stuck past a few deadlines, or a replayed GPU
  that never appears again) is left out of the list, and the monitor reports it as lost;
- a failure of the whole read (driver wedged, ``nvidia-smi`` hung) raises
  :class:`BackendError`; the monitor retries with backoff;
- a finite source (``replay:``) raises :class:`TraceEnded` when it has nothing left;
- a backend may name the sample fields it can fill at all (``reported_fields``), so the
  monitor can say which hard signals it cannot see, and per GPU those of them it cannot fill
  for that GPU now (``unreported_fields``: GPU id -> names; ``xid`` for an NVML GPU that is
  not registered for XID events, whose empty ``xid`` would otherwise read as "none");
- a backend may report driver states the CSV cannot hold (``conditions``: GPU id -> names,
  for the latest sample): ``gpu_is_lost`` or ``wedged`` for a GPU it left out (or
  ``device_lost``: left out with no more to say, as nvidia-smi's "Unknown Error" line for a
  GPU it has no handle for), ``reset_required`` or ``row_remap_failure`` for one it kept. A
  GPU named left out is reported lost even if it was never sampled. The monitor keeps them
  as health evidence (:mod:`ftmaster.monitor.health`);
- a backend may read only some GPUs (``select_gpus(watched, excluded)``, ``watched`` None for
  all of its own): an excluded GPU then gets no call at all;
- a backend may fake a fault in its own reads (``inject(injection)``: ``wedge`` blocks a GPU's
  reads until ``recover``).

``nvml`` and ``sim`` read each GPU on its own bounded worker
(:mod:`ftmaster.monitor.backends.bounded`), so a wedged GPU blinds only itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

from ftmaster.monitor.sample import GpuSample

if TYPE_CHECKING:
    from ftmaster.monitor.backends.bounded import ReadBounds

BACKEND_NAMES = ("nvml", "smi", "sim", "replay:PATH")


class BackendError(RuntimeError):
    """The backend could not produce a sample this time; worth retrying."""


class TraceEnded(Exception):
    """A recorded trace has no more samples."""


class Backend(Protocol):
    name: str

    def sample(self) -> list[GpuSample]: ...

    def close(self) -> None: ...


def make_backend(spec: str, *, num_gpus: int = 8, seed: int = 0,
                 gpu_ids: Sequence[int] | None = None, bounds: ReadBounds | None = None) -> Backend:
    """Build a backend from ``nvml``, ``smi``, ``sim`` or ``replay:PATH``; ValueError if unknown.

    ``num_gpus`` and ``seed`` are for ``sim``; ``gpu_ids`` restricts every backend to those
    ids; ``bounds`` sets the read and set-up deadlines of ``nvml`` and ``sim``.
    """
    if spec == "nvml":
        from ftmaster.monitor.backends.nvml import NvmlBackend
        return NvmlBackend(gpu_ids=gpu_ids, bounds=bounds)
    if spec == "smi":
        from ftmaster.monitor.backends.smi import SmiBackend
        return SmiBackend(gpu_ids=gpu_ids)
    if spec == "sim":
        from ftmaster.monitor.backends.sim import SimBackend
        return SimBackend(num_gpus=num_gpus, seed=seed, gpu_ids=gpu_ids, bounds=bounds)
    if spec.startswith("replay:"):
        from ftmaster.monitor.backends.replay import ReplayBackend
        path = spec[len("replay:"):]
        if not path:
            raise ValueError("replay: needs a path, e.g. replay:runs/x/gpu_metrics.csv")
        return ReplayBackend(Path(path), gpu_ids)
    raise ValueError(f"unknown backend {spec!r}; choose one of {', '.join(BACKEND_NAMES)}")
