"""Atomic writes killed mid-write: what they leave, and the start that removes it (and only it)."""

import fcntl
import subprocess
import sys
import textwrap
import time

import psutil

from ftmaster.peer_files import PeerServeConfig, PeerServer, new_secret
from ftmaster.recovery.checkpoints import iteration_dir, remove_abandoned_writes
from ftmaster.recovery.manifest import digest_file
from ftmaster.runfiles import atomic_file, remove_abandoned_temp_files


def killed_before_the_rename(code: str) -> None:
    """Run ``code`` in a process that is SIGKILLed where the write would rename its temp file."""
    prelude = textwrap.dedent("""
        import os, signal, sys
        from pathlib import Path
        os.replace = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_write_killed_before_its_rename_leaves_a_temp_the_next_start_removes(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    (tmp_path / ".ftmaster_tracker.lock").write_text("")
    killed_before_the_rename(f"""
        from ftmaster.runfiles import atomic_write_text
        atomic_write_text(Path({str(tmp_path)!r}) / "latest_checkpointed_iteration.txt", "6\\n")
    """)
    assert len(hidden(tmp_path)) == 2  # the lock file and the leftover

    remove_abandoned_temp_files(tmp_path, time.time())

    assert hidden(tmp_path) == [".ftmaster_tracker.lock"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5\n"


def test_a_live_writers_temp_and_one_newer_than_the_start_are_kept(tmp_path):
    with atomic_file(tmp_path / "heartbeat.json") as live:
        live.write(b"{}")
        remove_abandoned_temp_files(tmp_path, time.time() + 60)
        assert len(hidden(tmp_path)) == 1
    killed_before_the_rename(f"""
        from ftmaster.runfiles import atomic_write_text
        atomic_write_text(Path({str(tmp_path)!r}) / "heartbeat.json", "{{}}")
    """)
    remove_abandoned_temp_files(tmp_path, time.time() - 60)  # made after that start
    assert len(hidden(tmp_path)) == 1


def test_a_temp_that_cannot_be_locked_is_kept(tmp_path, monkeypatch):
    """A file system without locks cannot tell a live writer on another node from a dead one."""
    killed_before_the_rename(f"""
        from ftmaster.runfiles import atomic_write_text
        atomic_write_text(Path({str(tmp_path)!r}) / "heartbeat.json", "{{}}")
    """)

    def no_locks(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    remove_abandoned_temp_files(tmp_path, time.time())
    assert len(hidden(tmp_path)) == 1


def test_a_peer_copy_killed_mid_file_leaves_nothing_in_the_memory_tier_after_its_start(tmp_path):
    """The shard being copied is the size of a checkpoint's part, in RAM, in a checkpoint's
    folder the tier may keep for long; nothing took its temp file away."""
    peer, here = tmp_path / "peer", tmp_path / "here"
    shard = iteration_dir(peer, 6) / "__0_0.distcp"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"x" * (1 << 20))
    kept = iteration_dir(here, 6)
    kept.mkdir(parents=True)
    (kept / "common.pt").write_bytes(b"common")
    secret = new_secret()
    server = PeerServer(PeerServeConfig(peer, secret))
    try:
        digest = digest_file(shard)
        killed_before_the_rename(f"""
            from ftmaster.peer_files import PeerClient
            from ftmaster.recovery.manifest import FileDigest
            PeerClient({server.url!r}, {secret!r}).fetch(
                "iter_0000006/__0_0.distcp", Path({str(kept)!r}) / "__0_0.distcp",
                FileDigest({digest.bytes}, {digest.digest!r}))
        """)
    finally:
        server.close()
    assert len(hidden(kept)) == 1

    remove_abandoned_writes(here, time.time())

    assert sorted(p.name for p in kept.iterdir()) == ["common.pt"]


def test_ftmaster_starting_removes_what_killed_writers_left_in_its_run_folder_and_tiers(
        tmp_path, monkeypatch):
    """The trainer's heartbeat (every iteration), the monitor's flag, a tier's tracker: each
    killed mid-write left a temp file in a folder the run keeps using, that nothing removed."""
    from ftmaster.launch import check_layout
    from ftmaster.supervisor import Supervisor, SupervisorConfig
    from test_launch_parts import MODEL
    from test_supervisor_console import QuietMonitor

    run, save, memory = tmp_path / "run", tmp_path / "save", tmp_path / "shm"
    kept = iteration_dir(save, 5)
    kept.mkdir(parents=True)
    (kept / "common.pt").write_bytes(b"kept")
    for write in (f"runfiles.write_heartbeat(Path({str(run)!r}), 5, 60)",
                  f"runfiles.write_flag(runfiles.trigger_flag_path(Path({str(run)!r})), gpu=0)",
                  f"advance_tracker(Path({str(memory)!r}), 5)",
                  f"runfiles.atomic_write_text(Path({str(kept)!r}) / 'ftmaster_save.json', '')"):
        killed_before_the_rename(f"""
            from ftmaster import runfiles
            from ftmaster.recovery.checkpoints import advance_tracker
            {write}
        """)
    folders = (run, run / "flags", memory, kept)
    assert [len(hidden(folder)) for folder in folders] == [1, 1, 2, 1]  # (and the tier's lock)
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: time.time())  # after the kills
    command = (*MODEL, "--save", str(save), "--non-persistent-ckpt-type", "global",
               "--non-persistent-global-ckpt-dir", str(memory))
    Supervisor(SupervisorConfig(run_dir=run, command=command, gpus=(0, 1, 2, 3),
                                first_plan=check_layout(MODEL, 4, None, None)), QuietMonitor())

    assert [hidden(folder) for folder in folders] == [[], [], [".ftmaster_tracker.lock"], []]
    assert (save / "iter_0000005" / "common.pt").read_bytes() == b"kept"
