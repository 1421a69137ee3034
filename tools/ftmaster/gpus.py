"""Which GPUs a job runs on, and how each attempt tells CUDA.

ftmaster names GPUs by NVML index (PCI bus order) everywhere: plans, events, the monitor.
CUDA is told the same GPUs by **UUID** when NVML knows them, so a GPU that drops out of
CUDA's enumeration after a failure cannot shift the others onto the wrong devices; by index
(with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML's order) otherwise.

``CUDA_VISIBLE_DEVICES`` may list indices or UUIDs (a unique prefix is enough, as for CUDA).
A GPU in MIG mode is refused: CUDA would see its instances, not the GPU the plan counts. A
GPU the probe found unusable (wedged, lost, needing a reset) is left out, with a warning.
Without NVML (a CPU machine, ``sim`` or ``replay`` rehearsals with ``--nproc-per-node``) the
GPUs are virtual slots ``0..N-1``; a ``CUDA_VISIBLE_DEVICES`` that is set but empty stays
empty for every attempt, so no real GPU is ever exposed behind the user's back.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ftmaster.monitor.backends import BackendError
from ftmaster.monitor.backends.nvml import GpuIdentity, index_for_uuid, probe_gpus
from ftmaster.monitor.backends.smi import run_killable

NVIDIA_SMI_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class JobGpus:
    """The GPUs of a job and what CUDA is told about them."""

    ids: tuple[int, ...]
    """NVML indices (virtual slots without NVML), in the first attempt's local-rank order."""
    uuids: Mapping[int, str] = field(default_factory=dict)
    """UUID per index, where NVML gave one."""
    hidden: bool = False
    """The user hid every GPU (``CUDA_VISIBLE_DEVICES=""``): attempts see none either."""
    left_out: Mapping[int, str] = field(default_factory=dict)
    """GPUs the probe found unusable, and why."""

    def cuda_env(self, gpus: Sequence[int]) -> dict[str, str]:
        """The environment that restricts an attempt to ``gpus``, local rank ``r`` on
        ``gpus[r]``."""
        if self.hidden:
            return {"CUDA_VISIBLE_DEVICES": ""}
        names = [self.uuids.get(gpu, str(gpu)) for gpu in gpus]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def visible_entries(value: str | None) -> tuple[str, ...] | None:
    """``CUDA_VISIBLE_DEVICES`` as entries; None when unset, () when set but empty. As for
    CUDA, a negative index ends the list: ``-1`` is the usual way to hide every GPU."""
    if value is None:
        return None
    entries = [entry.strip() for entry in value.split(",") if entry.strip()]
    return tuple(itertools.takewhile(lambda entry: not entry.startswith("-"), entries))


def probe(timeout_s: float = PROBE_TIMEOUT_S) -> list[GpuIdentity] | None:
    """The GPUs the driver sees: from NVML (bounded; with UUIDs and MIG modes), else counted
    by ``nvidia-smi -L``; None when neither can tell."""
    try:
        return probe_gpus(timeout_s)
    except BackendError:
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:  # when NVML timed out, the driver may be wedged, and nvidia-smi stuck in it
        code, listing, _ = run_killable(["nvidia-smi", "-L"], NVIDIA_SMI_TIMEOUT_S)
    except BackendError:
        return None
    if code != 0:
        return None
    count = sum(line.startswith("GPU ") for line in listing.splitlines())
    return [GpuIdentity(index, None, None) for index in range(count)]


def _index(entry: str, identities: Sequence[GpuIdentity] | None) -> int:
    if entry.isdigit():
        return int(entry)
    if identities is None:
        raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} names a GPU by UUID; mapping it "
                         "needs NVML (nvidia-ml-py and a driver)")
    try:
        return index_for_uuid(entry, identities)
    except ValueError as error:
        unread = [g for g in identities if g.uuid is None and g.problem]
        if not str(error).startswith("no GPU has UUID") or not unread:
            raise
    # A lost or wedged GPU tells NVML no UUID: the entry names it, or nothing at all.
    if len(unread) == 1:
        return unread[0].index
    raise ValueError(f"no usable GPU has UUID {entry}, and NVML could not read the UUIDs of "
                     + ", ".join(f"GPU {g.index} ({g.problem})" for g in unread)
                     + ": leave the unusable ones out of CUDA_VISIBLE_DEVICES")


def choose_job_gpus(nproc: int | None, entries: tuple[str, ...] | None,
                    identities: Sequence[GpuIdentity] | None) -> JobGpus:
    """The job's GPUs: ``CUDA_VISIBLE_DEVICES`` order, else every GPU the probe found, minus
    unusable ones, the first ``nproc`` of them; virtual slots when there are none and
    ``nproc`` is given. ValueError (one line) when that cannot be done."""
    known = {g.index: g for g in identities or ()}
    candidates = ([_index(entry, identities) for entry in entries] if entries is not None
                  else sorted(known))
    twice = next((gpu for index, gpu in enumerate(candidates) if gpu in candidates[:index]), None)
    if twice is not None:  # two local ranks on one GPU: the plan would count it twice
        raise ValueError(f"CUDA_VISIBLE_DEVICES names GPU {twice} twice")
    unknown = [gpu for gpu in candidates if known and gpu not in known]
    if unknown:
        raise ValueError(f"CUDA_VISIBLE_DEVICES names GPU {unknown[0]}, which NVML does not see "
                         f"(it sees {len(known)})")
    left_out = {gpu: known[gpu].problem for gpu in candidates if gpu in known and known[gpu].problem}
    usable = [gpu for gpu in candidates if gpu not in left_out]
    hidden = entries == ()
    if nproc is None:
        if not usable:
            raise ValueError("no GPU is visible: give --nproc-per-node N (on a machine without "
                             "GPUs, with --monitor-backend sim)")
        chosen = tuple(usable)
    elif not candidates:
        return JobGpus(tuple(range(nproc)), hidden=hidden)
    elif len(usable) < nproc:
        why = "; ".join(f"GPU {gpu} {problem}" for gpu, problem in left_out.items())
        raise ValueError(f"--nproc-per-node {nproc} needs {nproc} GPUs, but only {len(usable)} "
                         f"are usable ({','.join(map(str, usable))})" + (f": {why}" if why else ""))
    else:
        chosen = tuple(usable[:nproc])
    for gpu in chosen:
        if gpu in known and known[gpu].mig_enabled:
            raise ValueError(f"GPU {gpu} is in MIG mode: ftmaster plans whole GPUs; turn MIG off "
                             f"(nvidia-smi -i {gpu} -mig 0) or leave the GPU out of "
                             "CUDA_VISIBLE_DEVICES")
    uuids = {gpu: known[gpu].uuid for gpu in chosen if gpu in known and known[gpu].uuid}
    return JobGpus(chosen, uuids, hidden, left_out)
