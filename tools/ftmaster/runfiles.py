"""The run directory contract shared by the monitor, the trainer and the supervisor.

Layout (``FTMASTER_RUN_DIR``)::

    flags/trigger_checkpoint.flag   written by the monitor
    flags/save_now.flag             read by the trainer
    gpu_metrics.csv                 monitor samples
    events.jsonl                    one JSON object per line, each with "event" and "time"
    heartbeat.json                  training progress, written by local rank 0 every iteration
    logs/                           one training log per launch attempt
    ranks/                          each attempt's rank records

With ``ftmaster launch --nnodes``, each node keeps this layout in ``RUN_DIR/node_<R>/``.

Every writer here is atomic or append-only, so a reader never sees half a record.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import math
import os
import re
import reprlib
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, TextIO, TypeVar

_T = TypeVar("_T")

RUN_DIR_ENV = "FTMASTER_RUN_DIR"
LAUNCHED_AT_ENV = "FTMASTER_LAUNCHED_AT"
"""Unix time ftmaster launched the attempt: where every rank's start-up phases begin."""
ASSIGNED_AT_ENV = "FTMASTER_ASSIGNED_AT"
"""Unix time a warm worker received its rank: where its own start-up begins."""
HANG_TIMEOUT_ENV = "FTMASTER_HANG_TIMEOUT"
"""The supervisor's ``--hang-timeout`` in seconds: a wait in training that blocks its
heartbeat gives up before it (``megatron/training/async_saves.py``)."""
TRIGGER_FLAG = "trigger_checkpoint.flag"
SAVE_NOW_FLAG = "save_now.flag"


def run_dir_from_env() -> Path | None:
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def hang_timeout_from_env() -> float | None:
    """The supervisor's hang timeout, None without one (or a value that is no positive
    number: the variable is ftmaster's to set)."""
    try:
        seconds = float(os.environ.get(HANG_TIMEOUT_ENV, ""))
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


def is_finite_number(value: Any) -> bool:
    """Whether a JSON value is a finite number: not true or false (ints to Python), NaN or
    infinite, nor an integer past float range (JSON integers have no bound), on which
    ``math.isfinite`` and float arithmetic raise OverflowError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def json_excerpt(value: Any) -> str:
    """A file's JSON ``value`` as an error message quotes it: cut in its middle past 40
    characters, as ``reprlib`` cuts a Python value, so that a 400-digit number or a long
    string leaves the message one readable line."""
    text = json.dumps(value)
    limit = reprlib.aRepr.maxlong
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return f"{text[:head]}...{text[len(text) - (limit - 3 - head):]}"


def flags_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "flags"


def trigger_flag_path(run_dir: Path) -> Path:
    return flags_dir(run_dir) / TRIGGER_FLAG


def save_now_flag_path(run_dir: Path) -> Path:
    return flags_dir(run_dir) / SAVE_NOW_FLAG


def events_path(run_dir: Path) -> Path:
    return Path(run_dir) / "events.jsonl"


def metrics_csv_path(run_dir: Path) -> Path:
    return Path(run_dir) / "gpu_metrics.csv"


def heartbeat_path(run_dir: Path) -> Path:
    return Path(run_dir) / "heartbeat.json"


def logs_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "logs"


def ranks_dir(run_dir: Path) -> Path:
    """Each attempt's rank records and error files, and the replica merges' output."""
    return Path(run_dir) / "ranks"


def layout_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot be used, as a sentence for the user, when an entry stands where
    the layout wants another kind (a file where a folder goes, or a folder where a file goes);
    None when every entry that exists fits."""
    folders = (flags_dir(run_dir), logs_dir(run_dir))
    files = (events_path(run_dir), metrics_csv_path(run_dir), heartbeat_path(run_dir))
    misplaced = [f"{path} is not a folder" for path in folders if path.exists() and not path.is_dir()]
    misplaced += [f"{path} is a folder" for path in files if path.is_dir()]
    if not misplaced:
        return None
    return (f"run directory {run_dir} does not hold ftmaster's layout ({misplaced[0]}); "
            "give another --run-dir")


_NODE_DIR = re.compile(r"node_(0|[1-9][0-9]*)")


def node_dir(run_dir: Path, node_rank: int) -> Path:
    """A node's folder in a multi-node run directory: the single-node layout inside."""
    return Path(run_dir) / f"node_{node_rank}"


def node_ranks(run_dir: Path) -> list[int]:
    """The node ranks with a folder in ``run_dir``, in order; [] for a single-node run."""
    return [rank for rank, entry in _node_entries(run_dir) if entry.is_dir()]


def stray_node_entries(run_dir: Path) -> list[Path]:
    """The ``node_<R>`` entries of ``run_dir`` that are no folder (a file, a link to none), in
    rank order: whatever that node wrote is not there."""
    return [entry for _, entry in _node_entries(run_dir) if not entry.is_dir()]


def _node_entries(run_dir: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(Path(run_dir).iterdir())
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), entry) for entry in entries
                  if (m := _NODE_DIR.fullmatch(entry.name)))


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and a rename.

    ``durable=False`` skips the fsyncs: still never torn, but may be lost in a power cut.
    A durable write also syncs the folder, which holds the rename itself.
    """
    atomic_write_bytes(path, text.encode(), durable)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """:func:`atomic_write_text` for bytes."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, durable) as handle:
        handle.write(data)


TEMP_SUFFIX = ".ftmaster-tmp"
_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX))
"""The temp names :func:`atomic_file` gives: ``.<name>.<8 random>.ftmaster-tmp``."""


@contextlib.contextmanager
def atomic_file(path: Path, durable: bool = True, mode: int = 0o644) -> Iterator[IO[bytes]]:
    """A new temp file beside ``path`` to write; renamed onto ``path`` when the block ends,
    removed when it raises; FileNotFoundError when the folder is gone. Every atomic writer
    goes through here, so a writer killed mid-write leaves only a name
    :func:`remove_abandoned_temp_files` knows. The temp file is locked until it is renamed:
    that tells a live writer's (on any node of a shared file system) from a dead one's.
    ``durable`` as in :func:`atomic_write_text`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            _lock_if_possible(fd)
            os.fchmod(fd, mode)  # mkstemp's 0600 would hide most files from other users' tools
            yield handle
            handle.flush()
            if durable:
                os.fsync(fd)
            os.replace(tmp, path)  # before the close, which lets go of the lock
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def _lock_if_possible(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise


def remove_abandoned_temp_files(folder: Path, older_than: float) -> None:
    """Remove from ``folder`` the temp files of :func:`atomic_file` that killed writers left:
    made before ``older_than`` (the caller's start: a write under way is newer) and locked by
    no live writer. One whose lock cannot be taken or tested (a file system without locks) is
    kept: it may be a live writer's on another node."""
    try:
        entries = [entry for entry in Path(folder).iterdir() if _TEMP_NAME.fullmatch(entry.name)]
    except OSError:
        return
    for entry in entries:
        try:
            fd = os.open(entry, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_mtime < older_than:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                entry.unlink(missing_ok=True)
        except OSError:  # held by a live writer, or no locks here
            pass
        finally:
            os.close(fd)


def fsync_path(path: Path) -> None:
    """A file's bytes, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_flag(path: Path, **reason: Any) -> None:
    """Atomically write a request flag whose JSON body says who asked and why."""
    atomic_write_text(path, json.dumps({"time": time.time(), **reason}) + "\n")


def read_flag(path: Path) -> dict[str, Any] | None:
    """Return the flag's request, or None when there is no flag.

    A flag that exists but is empty, malformed or unreadable (not UTF-8, JSON nested past
    the parser's depth, a FIFO, whose open would wait for a writer forever and take every
    later request with it) is still a request: it comes back as ``{"unreadable": True}``
    instead of raising.
    """
    try:
        with open(_open_regular(Path(path)), encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return {"unreadable": True}
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return {"unreadable": True}
    return body if isinstance(body, dict) else {"unreadable": True}


def write_heartbeat(run_dir: Path, iteration: int, consumed_samples: int,
                    first_iteration: int | None = None, finished: bool = False,
                    compute: dict | None = None, evaluated: int | None = None) -> None:
    """Training progress for hang detection; cheap enough to write every iteration.

    ``first_iteration`` is the first iteration this process completed: a reader that polls
    may first see a later one, and a relaunch's ``resumed`` event needs the first.
    ``finished``: training ended and its last checkpoint is durable; only the exit remains,
    which is never a hang. ``compute``: every rank's compute time of the last iterations,
    ``{"stages": [pipeline stage per rank], "replicas": [data-parallel index per rank],
    "ms": {"<iteration>": [ms per rank or null]}}`` (straggler detection; absent when not
    measured). ``evaluated``: the validation steps done so far at ``iteration`` (an
    evaluation writes no new iteration for as long as it runs, minutes on a large model).
    """
    body = {"iteration": iteration, "consumed_samples": consumed_samples, "time": time.time(),
            "pid": os.getpid(), "first_iteration": first_iteration, "finished": finished}
    if compute is not None:
        body["compute"] = compute
    if evaluated is not None:
        body["evaluated"] = evaluated
    atomic_write_text(heartbeat_path(run_dir), json.dumps(body) + "\n", durable=False)


def read_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    """The last heartbeat, or None (unknown) when there is none yet, it cannot be read, or
    a field the supervisor acts on is malformed: taken as it came, ``"iteration": true``
    was progress to iteration 1 and ``"finished": "false"`` a finished schedule. A FIFO in
    its place is unknown too, not a wait for a writer."""
    try:
        with open(_open_regular(heartbeat_path(run_dir)), "rb") as handle:
            body = json.loads(handle.read())
    except (OSError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and _well_formed_heartbeat(body) else None


def _well_formed_heartbeat(body: dict[str, Any]) -> bool:
    """Whether the fields :func:`write_heartbeat` writes have its types (an optional one
    may be absent: a script writing its own heartbeat)."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    stamp = body.get("time", 0.0)
    return (count(body.get("iteration"))
            and (body.get("first_iteration") is None or count(body["first_iteration"]))
            and (body.get("evaluated") is None or count(body["evaluated"]))
            and isinstance(body.get("finished", False), bool)
            and (count(stamp) or isinstance(stamp, float) and math.isfinite(stamp)))


def append_event(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event line to ``events.jsonl``; one ``write`` call keeps lines whole.

    A full disk may take only part of a line (the room left in the file's last block): that
    raises ENOSPC, and the next append ends the torn line first, so that it loses only itself.
    """
    record = {"event": event, "time": time.time(), **fields}
    path = events_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # glued to a torn line, this event would be unreadable too
        written = os.write(fd, line)
    finally:
        os.close(fd)
    if written < len(line):  # another writer may append meanwhile: the rest cannot follow
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return record


MIN_ROOM_BYTES = 1 << 20
"""Less free space than this in the run directory, and training's log lines, heartbeats and
events are about to fail (each attempt's log is training's own output)."""


def room_problem(run_dir: Path) -> str | None:
    """Why the run directory cannot take the run's files now (read-only, or out of room), or
    None."""
    try:
        usage = os.statvfs(run_dir)
    except OSError as error:
        return f"{run_dir}: {error.strerror}"
    if usage.f_flag & os.ST_RDONLY:
        return f"{run_dir} is on a read-only filesystem"
    free = usage.f_bavail * usage.f_frsize
    return f"{run_dir} has {free} bytes free" if free < MIN_ROOM_BYTES else None


class WriteOutage:
    """Writes of run files that must never end training or ftmaster (a run directory that
    fills up, or goes read-only, mid-run): a failed write is skipped and told once per file
    in this process (whichever writer meets it first), through ``failed``, then its recovery
    through ``recovered``."""

    _failing: set[str] = set()  # a file's outage is this process's, not one writer's

    def __init__(self, failed: Callable[[str], None], recovered: Callable[[str], None],
                 consequence: str) -> None:
        self._failed, self._recovered = failed, recovered
        self._consequence = consequence

    def write(self, path: Path, write: Callable[[], _T]) -> _T | None:
        """``write()``'s result, or None when it raised an OSError."""
        try:
            result = write()
        except OSError as error:
            if str(path) not in self._failing:
                self._failing.add(str(path))
                code = errno.errorcode.get(error.errno or 0, "error")
                self._failed(f"cannot write {path} ({code}: {error.strerror}); "
                             f"{self._consequence} until it can")
            return None
        if str(path) in self._failing:
            self._failing.discard(str(path))
            self._recovered(f"{path} is written again")
        return result

    def append_event(self, run_dir: Path, event: str, **fields: Any) -> None:
        """:func:`append_event`, skipped while ``events.jsonl`` cannot be written."""
        self.write(events_path(run_dir), lambda: append_event(run_dir, event, **fields))


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """All well-formed events in order; a torn or foreign line is skipped, never fatal (bytes
    that are not UTF-8, from a torn write or a disk error, are replaced: at worst their line
    is skipped)."""
    path = events_path(run_dir)
    if not path.exists():
        return []
    return parse_events(path.read_text(errors="replace").splitlines())


def parse_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The well-formed events among ``lines`` (of an ``events.jsonl``), in order; a torn or
    foreign line is skipped."""
    events = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            continue
        if isinstance(record, dict) and "event" in record:
            events.append(record)
    return events


TAIL_BLOCK = 1 << 16
"""How much of a file's end is read at a time to find its last newline."""


def open_whole_lines(path: Path, **text: Any) -> tuple[TextIO, int]:
    """``path`` opened for reading as text (``text``: ``open``'s ``encoding``, ``errors`` and
    ``newline``) up to the end of its last whole line, and how many bytes follow it.

    Those bytes are a torn last line, of a writer killed mid-write or one still writing: read
    as a line, a value cut short ("8" of "80000") would pass for a whole one. What is appended
    after the open is not read either. Anything but a regular file raises an OSError.
    """
    raw = open(_open_regular(path), "rb", buffering=0)
    try:
        size = raw.seek(0, os.SEEK_END)
        end = _whole_lines_end(raw, size)
        raw.seek(0)
        return io.TextIOWrapper(io.BufferedReader(_Prefix(raw, end)), **text), size - end
    except BaseException:
        raw.close()
        raise


@contextlib.contextmanager
def open_output(path: Path, mode: str = "w", **text: Any) -> Iterator[IO]:
    """``path`` to be written from its start (``mode``: ``"w"`` or ``"wb"``; ``text``:
    ``open``'s ``encoding``, ``errors`` and ``newline``). A regular file (or a new one) is
    written beside it and renamed into place when the block ends: a reader (a browser
    refreshing the page, a dashboard polling the JSON) never sees it torn, and a write that
    fails (a full disk) leaves the one before. A FIFO someone reads and a character device
    (``/dev/null``, ``/dev/stdout`` piped or on a terminal) are written as they are. A FIFO
    nobody reads would hold the open until some reader came, forever: it raises an OSError
    without waiting, as a socket or a block device does, before a byte is written."""
    try:
        kind = os.stat(path).st_mode
    except FileNotFoundError:
        kind = stat.S_IFREG | 0o666 & ~_umask()  # as open() would make it
    if stat.S_ISREG(kind):
        with atomic_file(Path(os.path.realpath(path)), mode=stat.S_IMODE(kind)) as raw:
            handle = raw if "b" in mode else io.TextIOWrapper(raw, **text)
            yield handle
            handle.flush()
        return
    with _opened_as_it_is(path, mode, **text) as handle:
        yield handle


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it, for every thread)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def _opened_as_it_is(path: Path, mode: str, **text: Any) -> IO:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, "a FIFO nobody reads (or a socket)", str(path)) from None
        raise
    try:
        kind = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(kind) or stat.S_ISCHR(kind)):
            raise _not_regular(path)
        os.set_blocking(fd, True)
        return open(fd, mode, **text)
    except BaseException:
        os.close(fd)
        raise


def is_stdout(handle: IO) -> bool:
    """Whether ``handle`` writes where stdout does (``--json-out /dev/stdout``), so that a
    command's text for people goes elsewhere and leaves the pipe to the data. Never
    ``/dev/null``: nobody reads the data there, and text moved to stderr would be noise."""
    try:
        mine, out = os.fstat(handle.fileno()), os.fstat(sys.stdout.fileno())
        sink = os.stat(os.devnull)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False  # no stdout file (closed, or a test's capture)
    return os.path.samestat(mine, out) and not os.path.samestat(mine, sink)


def failed_path(error: OSError, path: Path | str) -> str:
    """The file ``error`` names, else ``path``, the one being written: an OSError of a write or
    a close (a full disk) names no file."""
    return str(error.filename or path)


def _open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``. The open does not wait: a FIFO in
    the file's place would hold the open (then the read) until some writer came, forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ENXIO:  # a socket
            raise _not_regular(path) from None
        raise
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    raise _not_regular(path)


def _not_regular(path: Path) -> OSError:
    return OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device)", str(path))


def torn_line_note(path: Path) -> str:
    """What a reader of :func:`open_whole_lines` says of a torn last line it left out."""
    return (f"{path}: its last line is incomplete (no newline: still being written, or cut "
            "short), skipped")


def _whole_lines_end(raw: io.RawIOBase, size: int) -> int:
    """Just past the last newline of the ``size``-byte file ``raw``; 0 when it has none."""
    end = size
    while end > 0:
        start = max(0, end - TAIL_BLOCK)
        raw.seek(start)
        newline = raw.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


class _Prefix(io.RawIOBase):
    """The first ``size`` bytes of the binary file ``raw``, which it closes."""

    def __init__(self, raw: io.RawIOBase, size: int) -> None:
        super().__init__()
        self._raw, self._left = raw, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self._raw.readinto(memoryview(buffer)[:self._left]) if self._left else 0
        self._left -= count
        return count

    def close(self) -> None:
        self._raw.close()
        super().close()
