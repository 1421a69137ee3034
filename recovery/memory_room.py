"""Room for the memory tier: its folder's free bytes and, on tmpfs, what this process's
memory cgroup has left.

tmpfs pages are charged to the memory cgroup of the process that writes them (a Kubernetes
pod's ``medium: Memory`` emptyDir, a container's ``/dev/shm``): with ``/dev/shm`` showing
plenty free, a save past the cgroup's limit had the kernel reclaim or OOM-kill a process of
the cgroup, most likely a rank, in the middle of the save, where a save that does not fit
must fail alone. A cgroup's left room is its limit less its usage, plus the page cache it
may reclaim (its file pages but tmpfs's own, which it cannot drop without swap), the least
of it over the cgroup and its ancestors (cgroup v2 and v1).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 2 ** 60
"""At or past this a v1 limit is none (unlimited reads as 9223372036854771712)."""


class Room(NamedTuple):
    free: int
    """The bytes a checkpoint may take."""
    note: str
    """'' when the file system's free bytes are the bound, else words saying the cgroup is."""


def room(folder: Path, mounts: Path = Path("/proc/self/mounts"),
         cgroups: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> Room:
    """The room for checkpoints in ``folder`` (an OSError where it cannot be looked at)."""
    free = shutil.disk_usage(folder).free
    left = cgroup_memory_left(cgroups, root) if on_tmpfs(folder, mounts) else None
    if left is None or left >= free:
        return Room(free, "")
    return Room(left, f" (its file system has {free / 1e9:.2f} GB, but this process's memory "
                      "cgroup, which tmpfs pages are charged to, has only that left)")


def on_tmpfs(folder: Path, mounts: Path = Path("/proc/self/mounts")) -> bool:
    """Whether ``folder`` lies on a tmpfs (its longest mount point's type); False when the
    mounts cannot be read."""
    where = os.path.realpath(folder)
    best, kind = "", None
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind == "tmpfs"


def cgroup_memory_left(cgroups: Path = Path("/proc/self/cgroup"),
                       root: Path = CGROUP_ROOT) -> int | None:
    """The least room any memory cgroup holding this process has left; None with no limit
    (or nothing readable)."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return None
    lefts = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2's unified hierarchy
            lefts += _lefts(root, path, "memory.max", "memory.current", ("file",), ("shmem",))
        elif "memory" in controllers.split(","):
            lefts += _lefts(root / "memory", path, "memory.limit_in_bytes",
                            "memory.usage_in_bytes", ("total_cache", "cache"),
                            ("total_shmem", "shmem"))
    return min(lefts, default=None)


def _lefts(mount: Path, path: str, limit_name: str, usage_name: str,
           cache_names: tuple[str, ...], shmem_names: tuple[str, ...]) -> list[int]:
    """The room left in the cgroup at ``path`` under ``mount`` and in each of its ancestors
    that has a limit. A cgroup namespace shows the process's own as the mount's root: the
    path's parts that are not there are skipped."""
    parts = [part for part in path.strip().split("/") if part]
    lefts = []
    for depth in range(len(parts), -1, -1):
        folder = mount.joinpath(*parts[:depth])
        limit = _number(folder / limit_name)
        usage = _number(folder / usage_name)
        if limit is None or usage is None or limit >= NO_LIMIT:
            continue
        stat = _stat(folder / "memory.stat")
        cache = next((stat[name] for name in cache_names if name in stat), 0)
        shmem = next((stat[name] for name in shmem_names if name in stat), 0)
        lefts.append(max(0, limit - usage + max(0, cache - shmem)))
    return lefts


def _number(path: Path) -> int | None:
    """A cgroup file's number; None when absent, unreadable or ``max``."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stat = {}
    for line in lines:
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[name] = int(value)
    return stat
