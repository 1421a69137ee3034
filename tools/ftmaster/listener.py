"""The listener: moves ``trigger_checkpoint.flag`` to ``save_now.flag`` within a poll interval.

The paper bridged the two files with a 30-second shell loop. Here a thread polls every
``interval_s`` (0.1 s by default) and moves the flag with one ``rename``: the request body
travels unchanged, and a trigger the monitor writes while the move happens is a new file,
moved on the next poll. Every move appends a ``checkpoint_request`` event (``source``,
``gpu``). A trigger that is empty or unreadable is a request all the same.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ftmaster import runfiles

log = logging.getLogger("ftmaster.listener")


def request_source(body: dict) -> str:
    """Who asked: the flag's own ``source``, else the monitor when it names a GPU."""
    if isinstance(body.get("source"), str):
        return body["source"]
    return "monitor" if "gpu" in body else "unknown"


def move_request(run_dir: Path) -> dict | None:
    """Move one pending trigger to ``save_now.flag``; returns the event, or None if none."""
    trigger = runfiles.trigger_flag_path(run_dir)
    save_now = runfiles.save_now_flag_path(run_dir)
    try:
        os.replace(trigger, save_now)
    except FileNotFoundError:
        return None
    body = runfiles.read_flag(save_now) or {"unreadable": True}
    return runfiles.append_event(run_dir, "checkpoint_request", source=request_source(body),
                                 gpu=body.get("gpu"))


class Listener:
    """A daemon thread running :func:`move_request` every ``interval_s`` seconds."""

    def __init__(self, run_dir: Path, interval_s: float = 0.1) -> None:
        if not interval_s > 0:
            raise ValueError(f"listener interval must be > 0 s, got {interval_s}")
        self.run_dir = Path(run_dir)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftmaster-listener", daemon=True)

    def start(self) -> None:
        runfiles.flags_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                event = move_request(self.run_dir)
            except Exception as error:  # a full disk, a bad flag: neither may end the thread,
                # and with it every later request of the run
                log.error("cannot move the checkpoint trigger: %s: %s", type(error).__name__,
                          error)
                event = None
            if event is not None:
                gpu = "" if event["gpu"] is None else f" (GPU {event['gpu']})"
                log.warning("checkpoint requested by %s%s", event["source"], gpu)
            self._stop.wait(self.interval_s)
