"""``ftmaster launch``'s multi-node defaults under SLURM (``srun --ntasks-per-node=1 ftmaster
launch ...``), from the environment SLURM gives each task.

- ``--rdzv-id``: ``SLURM_JOB_ID``, and ``<id>-r<N>`` after the N-th requeue
  (``SLURM_RESTART_COUNT``). A requeued job keeps its id, and torch's etcd-v2 backend keeps a
  rendezvous' state for two hours (``EtcdRendezvousBackend._DEFAULT_TTL``), closed by the
  previous run's end or full of its dead nodes; a new id per run starts clean. The c10d store
  starts empty anyway.
- ``--node-rank``: ``SLURM_NODEID``, the node's index in the step, in SLURM's node order.
- ``--rdzv-endpoint``: the step's first node (``SLURM_STEP_NODELIST``, else
  ``SLURM_JOB_NODELIST``, expanded by ``scontrol show hostnames``) on port 29400, torch's c10d
  default. That is where node rank 0 runs, and with c10d its ftmaster serves the store. The
  step's list, not the job's: ``srun -N1 -w n2`` in an ``n[1-2]`` allocation runs node rank 0
  on n2 (SLURM 22.05, checked in ``tests/e2e/test_slurm.py``). With the c10d backend, node
  rank 0 is told to serve the store there (``is_host=1``) and the others not to, so a port
  another job's store holds is refused as such, never joined.
- ``--nnodes``: ``1:N`` for a step on N > 1 nodes (``SLURM_STEP_NUM_NODES``, else
  ``SLURM_NNODES``). MAX = N: every node of the step joins, so the first round closes as soon
  as all have arrived, and nodes beyond what the plan needs stand by as spares. MIN = 1: with
  ``--no-kill`` SLURM drops a failed node from the allocation for good (it can never rejoin
  this job), so a MIN of N would stop the job at the first node loss; whether the nodes left
  can still train is the planner's question, not the rendezvous'. There is no split brain to
  fear from a low MIN: all rounds go through the one store. Outside a step (the batch script
  itself, an ``salloc`` shell) or on one node it is None: one ftmaster, as without SLURM.

Explicit options always win (:func:`with_explicit_options`).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, replace
from typing import Callable, Mapping

C10D_PORT = 29400
"""torch elastic's default c10d rendezvous port (``c10d_rendezvous_backend.DEFAULT_PORT``)."""
SCONTROL_TIMEOUT_S = 10.0
"""``scontrol`` retries an unreadable slurm.conf for a minute; the pure expansion is instant."""

_OPTIONS = {"rdzv_id": "--rdzv-id", "node_rank": "--node-rank",
            "rdzv_endpoint": "--rdzv-endpoint", "nnodes": "--nnodes"}


class SlurmStepError(ValueError):
    """The SLURM step cannot run ftmaster as it is (one line)."""


@dataclass(frozen=True)
class SlurmDefaults:
    """Rendezvous options as SLURM gives them; None where it gives none."""

    rdzv_id: str | None = None
    """``--rdzv-id``: the job id, with ``-r<N>`` after the N-th requeue."""
    node_rank: int | None = None
    """``--node-rank``: ``SLURM_NODEID``, this node's index in the step."""
    rdzv_endpoint: str | None = None
    """``--rdzv-endpoint``: ``<first node of the step>:29400``."""
    nnodes: str | None = None
    """``--nnodes``: ``1:N`` for a step on N > 1 nodes; None outside a step or on one node."""
    store_host: bool | None = None
    """``is_host`` for the c10d store at that endpoint: the step's first node serves it, no
    other node ever does. Left to torch, a node whose endpoint names itself and finds the port
    taken joins whatever store holds it: a second job whose first node is the same host (shared
    nodes) met the first job's store, and lost it, exit 75, when that job ended. None with an
    endpoint given."""
    nodelist_problem: str | None = None
    """Why SLURM's node list gave no ``rdzv_endpoint`` (it could not be expanded), for the
    message that asks for one."""

    def __post_init__(self) -> None:
        if self.node_rank is not None and self.node_rank < 0:
            raise ValueError(f"--node-rank must be >= 0, got {self.node_rank}")


def slurm_defaults(environ: Mapping[str, str],
                   hostnames: Callable[[str], list[str]] | None = None) -> SlurmDefaults:
    """The rendezvous options SLURM's environment implies (all None when not under SLURM).

    ``hostnames`` expands a node list (default :func:`scontrol_hostnames`). A value SLURM gives
    that cannot be read is None, never a guess. SlurmStepError when the step runs more than
    one task on a node: each node needs exactly one ftmaster.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return SlurmDefaults()
    in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    nodes = _whole_number(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES"))
    tasks = _whole_number(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS"))
    if in_step and nodes is not None and tasks is not None and tasks > nodes:
        raise SlurmStepError(f"this SLURM step runs {tasks} tasks on {nodes} node(s); ftmaster "
                             "needs one per node: srun --ntasks-per-node=1 ftmaster launch ...")
    restarts = _whole_number(environ.get("SLURM_RESTART_COUNT"))
    nodelist = (environ.get("SLURM_STEP_NODELIST") if in_step else None) or \
        environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    first, problem = (_first_host(nodelist, hostnames or scontrol_hostnames) if nodelist
                      else (None, None))
    node_rank = _whole_number(environ.get("SLURM_NODEID"), minimum=0)
    return SlurmDefaults(
        rdzv_id=f"{job_id}-r{restarts}" if restarts else job_id,
        node_rank=node_rank,
        rdzv_endpoint=f"{first}:{C10D_PORT}" if first else None,
        nnodes=f"1:{nodes}" if in_step and nodes is not None and nodes > 1 else None,
        store_host=node_rank == 0 if first and in_step and node_rank is not None else None,
        nodelist_problem=problem)


def with_explicit_options(slurm: SlurmDefaults,
                          **explicit: object) -> tuple[SlurmDefaults, tuple[str, ...]]:
    """The options to use: each one given on the command line (not None) in place of SLURM's,
    and, for the console, one line per option that replaces a different SLURM value.

    ``explicit`` takes the field names: ``rdzv_id``, ``node_rank``, ``rdzv_endpoint``, ``nnodes``.
    """
    given = {name: value for name, value in explicit.items() if value is not None}
    chosen = replace(slurm, **given)
    if "rdzv_endpoint" in given:  # whose store it is, the user knows
        chosen = replace(chosen, store_host=None)
    notes = tuple(f"{_OPTIONS[name]} {value} given: SLURM's {getattr(slurm, name)} is not used"
                  for name, value in given.items()
                  if getattr(slurm, name) is not None and getattr(slurm, name) != value)
    return chosen, notes


def scontrol_hostnames(nodelist: str, timeout_s: float = SCONTROL_TIMEOUT_S) -> list[str]:
    """``scontrol show hostnames NODELIST``, bounded; :func:`expand_nodelist` when scontrol is
    missing, fails or times out. ValueError for a list either one rejects (scontrol prints
    nothing for it, and still exits 0)."""
    try:
        listing = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return expand_nodelist(nodelist)
    hosts = listing.split()
    if not hosts:
        raise ValueError(f"node list {nodelist!r}: scontrol cannot expand it")
    return hosts


_RANGE = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")  # ASCII digits, strtoul's 64 bits
MAX_HOSTS = 65536
"""The most hosts a node list may name here: SLURM's ``MAX_SLURM_NODES``, which is also the
most hosts scontrol expands from one range ("Too many hosts in range"). A larger list is
refused before it is listed: ``n[1-99999999999]`` took all the memory there was."""


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's host list syntax without ``scontrol``: ``n[1-3,5]``, ``gpu-[01-04]`` (zero
    padding kept), ``a1,b2``, ``r[1-2]-n[1-2]`` (every combination, in SLURM's order).
    ValueError (one line) for a list it cannot read, rather than a wrong host, and for one
    that names more than :data:`MAX_HOSTS`."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts += _expand_item(item, nodelist, MAX_HOSTS - len(hosts))
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no host")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"node list {nodelist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(nodelist[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"node list {nodelist!r}: unbalanced brackets")
    return [item.strip() for item in [*items, nodelist[start:]] if item.strip()]


def _expand_item(item: str, nodelist: str, room: int) -> list[str]:
    """The hosts of one item, at most ``room`` of them (else ValueError): each count is
    checked before its hosts are listed."""
    # re.split alternates the text around brackets with what is inside them.
    pieces = re.split(r"\[([^\[\]]*)\]", item)
    hosts = [""]
    for index, piece in enumerate(pieces):
        choices = _expand_ranges(piece, nodelist, room) if index % 2 else [piece]
        if len(hosts) * len(choices) > room:
            raise _too_many(nodelist)
        hosts = [host + choice for host in hosts for choice in choices]
    return hosts


def _expand_ranges(ranges: str, nodelist: str, room: int) -> list[str]:
    numbers: list[str] = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"node list {nodelist!r}: cannot read the range {part!r}")
        low, high = match[1], match[2] or match[1]
        if len(numbers) + int(high) - int(low) + 1 > room:
            raise _too_many(nodelist)
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def _too_many(nodelist: str) -> ValueError:
    return ValueError(f"node list {nodelist!r} names more than {MAX_HOSTS} hosts")


def _first_host(nodelist: str,
                hostnames: Callable[[str], list[str]]) -> tuple[str | None, str | None]:
    """The list's first host, or None and why."""
    try:
        hosts = hostnames(nodelist)
    except ValueError as error:
        return None, str(error)
    return (hosts[0], None) if hosts else (None, f"node list {nodelist!r} names no host")


def _whole_number(value: str | None, minimum: int = 1) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):  # absent, or not a number
        return None
    return number if number >= minimum else None
