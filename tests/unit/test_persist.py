"""The memory tier's persist copy, the two tiers' candidates and trackers, and the folder
ftmaster picks for the memory tier (real files; no torch)."""

import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftmaster import persist as persist_module
from ftmaster.peer_files import PeerMissing
from ftmaster.lock import RunDirLock
from ftmaster.persist import (RETRY_WAIT_S, PersistError, Persister, PersistSuperseded, Tiers,
                              checkpoint_bytes_guess, mark_owner, persist, persist_left_behind,
                              remove_partial_copies, tiers_of, with_memory_dir)
from ftmaster.recovery.argv_flags import flag_value
from ftmaster.recovery.checkpoints import (advance_tracker, is_complete, iteration_dir,
                                           list_iterations, mark_whole, newest_on_disk, pin,
                                           prunable_memory_checkpoints, read_tracker,
                                           tier_candidates, tracker_lock, tracker_path)
from megatron.training.checkpointing import (CheckpointMismatch, prepare_fresh_start,
                                             prune_memory_checkpoints, set_aside_newer)
from ftmaster.recovery.manifest import digest_bytes, read_manifest, size_problem, write_manifest
from helpers.trainer import wait_until


def fake_checkpoint(folder: Path, iteration: int, shard_bytes: int = 1000, kind="emergency") -> Path:
    """A complete checkpoint as far as the copy can tell: files, manifest, tracker."""
    path = iteration_dir(folder, iteration)
    path.mkdir(parents=True)
    files = {}
    for name, size in (("__0_0.distcp", shard_bytes), ("common.pt", 100), (".metadata", 50),
                       ("metadata.json", 20)):
        data = os.urandom(size)
        (path / name).write_bytes(data)
        files[name] = digest_bytes(data)
    write_manifest(path, kind, iteration, files)
    advance_tracker(folder, iteration)
    return path


def test_a_persisted_copy_is_complete_verified_and_named_by_the_disk_tracker(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    source = fake_checkpoint(memory, 8)
    done = persist(memory, disk, 8)
    assert (done.iteration, done.bytes) == (8, read_manifest(source).total_bytes)
    target = iteration_dir(disk, 8)
    for name in os.listdir(source):
        assert (target / name).read_bytes() == (source / name).read_bytes()
    assert read_tracker(disk) == 8
    assert persist(memory, disk, 8) is None  # the disk tier has it already


def test_a_damaged_memory_copy_is_never_persisted(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    source = fake_checkpoint(memory, 8)
    with open(source / "__0_0.distcp", "r+b") as shard:
        shard.write(b"XX")
    with pytest.raises(PersistError, match="__0_0.distcp does not match its checksum"):
        persist(memory, disk, 8)
    assert list_iterations(disk) == [] and read_tracker(disk) is None
    assert not list(disk.glob(".iter_*"))  # the partial copy is removed


def first_retry_wait_passed(persister: Persister) -> None:
    """As if RETRY_WAIT_S's first figure had passed since the copy failed."""
    iteration, now_from, poll_from = persister._retry
    persister._retry = (iteration, now_from - RETRY_WAIT_S[0], poll_from - RETRY_WAIT_S[0])


def test_a_damaged_memory_copy_is_not_tried_again_at_every_poll(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    source = fake_checkpoint(memory, 8)
    with open(source / "__0_0.distcp", "r+b") as shard:
        shard.write(b"XX")
    persister = Persister(memory, disk)
    assert persister.start(8)
    persister.wait(10)
    (failure,) = persister.take_results()
    assert "does not match its checksum" in str(failure)
    assert not persister.needs_copy(8)  # not at every poll: 27 re-reads of 86 MB in 9 s before
    assert not persister.needs_copy(8, retry_now=True)  # nor at once: it fails the same way
    first_retry_wait_passed(persister)
    assert persister.needs_copy(8, retry_now=True)  # an attempt's end or the run's tries again


def test_a_copy_without_a_manifest_is_refused(tmp_path):
    memory = tmp_path / "memory"
    iteration_dir(memory, 4).mkdir(parents=True)
    with pytest.raises(PersistError, match="no checksummed manifest"):
        persist(memory, tmp_path / "disk", 4)


def test_the_disk_tracker_never_moves_backwards(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(disk, 10, kind="periodic")
    fake_checkpoint(memory, 8)
    persist(memory, disk, 8)
    assert read_tracker(disk) == 10 and list_iterations(disk) == [10, 8]


@pytest.mark.parametrize("tracker", [None, "garbage\n"])
def test_without_a_usable_disk_tracker_a_persist_never_hides_a_newer_complete_folder(tmp_path, tracker):
    """A load then takes the newest complete folder: an older memory copy is not wanted, and
    a tracker naming it would have hidden the newer one."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(disk, 10, kind="periodic")
    if tracker is None:
        tracker_path(disk).unlink()
    else:
        tracker_path(disk).write_text(tracker)
    fake_checkpoint(memory, 8)
    assert not Persister(memory, disk).needs_copy(8)
    persist(memory, disk, 8)  # as a copy started before the folder appeared would
    assert tier_candidates(disk, None).candidates[0].iteration == 10
    assert read_tracker(disk) is None
    fake_checkpoint(memory, 12)
    persist(memory, disk, 12)
    assert read_tracker(disk) == 12


def test_a_tracked_folder_removed_by_hand_never_counts_as_on_disk(tmp_path):
    """A user removed a bad iter_9 by hand and left its tracker: a load takes 6, but disk
    counted as holding 9, so memory checkpoint 8 was never persisted, and a launch taking over
    the memory tier a killed run left (or the end of a run, its /dev/shm tier) removed it."""
    memory, disk, shm = tmp_path / "memory", tmp_path / "disk", tmp_path / "shm"
    fake_checkpoint(disk, 6)
    shutil.rmtree(fake_checkpoint(disk, 9))
    assert newest_on_disk(disk) == 6
    fake_checkpoint(memory, 8)
    assert Persister(memory, disk).needs_copy(8)
    left = left_memory_tier(shm, "ftmaster-old", disk, tmp_path / "old_run", 8)
    persist_left_behind(None, disk, resumes=True, say=lambda line: None, shm=shm)
    assert is_complete(iteration_dir(disk, 8)) and not left.exists()
    assert [c.iteration for c in tier_candidates(disk, None).candidates] == [8, 6]


def test_a_memory_copy_set_aside_during_the_copy_is_not_put_in_place(tmp_path):
    """A resume that discarded the memory copy's timeline sets it aside holding the disk
    tier's lock (as the trainer's Checkpointer does across both tiers); the copy then finds
    it gone when it takes that lock to move into place."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    source = fake_checkpoint(memory, 8)
    lock_held, release = threading.Event(), threading.Event()

    def set_aside():
        with tracker_lock(disk):
            lock_held.set()
            release.wait(10)
            source.rename(source.with_name(source.name + ".discarded-x"))

    thread = threading.Thread(target=set_aside)
    thread.start()
    lock_held.wait(10)
    threading.Timer(0.3, release.set).start()
    with pytest.raises(PersistError, match="was set aside while it was copied"):
        persist(memory, disk, 8)
    thread.join()
    assert list_iterations(disk) == [] and read_tracker(disk) is None


def test_a_memory_copy_replaced_by_another_timelines_during_the_copy_is_not_put_in_place(
        tmp_path, monkeypatch):
    """A resume set the copied checkpoint aside and the new timeline saved the same iteration
    again before the copy ended: its files were copied, the new one's manifest was not to be
    put beside them, nor the discarded checkpoint to land as the disk tier's newest."""
    import ftmaster.persist as persist_module

    memory, disk = tmp_path / "memory", tmp_path / "disk"
    source = fake_checkpoint(memory, 8)
    copy_file = persist_module._copy_verified

    def copy_then_replace(reader, target, expected):
        copy_file(reader, target, expected)
        if target.name == "metadata.json":  # the last of the files, before the manifest
            source.rename(source.with_name(source.name + ".discarded-x"))
            fake_checkpoint(memory, 8)

    monkeypatch.setattr(persist_module, "_copy_verified", copy_then_replace)
    with pytest.raises(PersistError, match="was set aside while it was copied"):
        persist(memory, disk, 8)
    assert list_iterations(disk) == [] and read_tracker(disk) is None


def test_a_persist_killed_mid_copy_leaves_the_tracker_on_the_previous_checkpoint(tmp_path):
    """SIGKILL of the process copying (ftmaster's supervisor) half way through a large shard."""
    memory, disk = Path("/dev/shm") / f"ftmaster-test-{os.getpid()}", tmp_path / "disk"
    try:
        fake_checkpoint(disk, 4, kind="periodic")
        fake_checkpoint(memory, 8, shard_bytes=1 << 30)
        copier = subprocess.Popen([sys.executable, "-c",
                                   "import sys; from ftmaster.persist import persist; "
                                   "persist(sys.argv[1], sys.argv[2], 8)", str(memory), str(disk)])
        partial = wait_until(lambda: next(disk.glob(".iter_0000008.partial-*/__0_0.distcp"), None),
                             timeout=60, interval=0.005, what="the copy to start")
        wait_until(lambda: partial.stat().st_size > 0, timeout=60, interval=0.001,
                   what="the copy to write")
        os.kill(copier.pid, signal.SIGKILL)
        copier.wait()
        assert partial.stat().st_size < 1 << 30  # killed mid-copy, not after
        assert read_tracker(disk) == 4 and list_iterations(disk) == [4]
        remove_partial_copies(disk)
        assert not list(disk.glob(".iter_*"))
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def many_file_checkpoint(folder: Path, iteration: int, count: int) -> None:
    path = iteration_dir(folder, iteration)
    path.mkdir(parents=True)
    files = {}
    for index in range(count):
        data = os.urandom(4000)
        (path / f"__{index}_0.distcp").write_bytes(data)
        files[f"__{index}_0.distcp"] = digest_bytes(data)
    write_manifest(path, "emergency", iteration, files)
    advance_tracker(folder, iteration)


@pytest.mark.parametrize("trial", range(3))
def test_a_peer_node_ftmaster_starting_mid_copy_never_leaves_a_tracked_checkpoint_short_of_files(
        tmp_path, trial):
    """Across nodes every node's ftmaster makes a Persister, which removes the --save's
    .partial folders it finds: on a node (re)started while rank 0's node copies, that is a
    live copy's folder, emptied while the copy goes on writing into it."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    many_file_checkpoint(memory, 8, 300)

    def peer_starts():
        wait_until(lambda: len(list(disk.glob(".iter_0000008.partial-*/*"))) >= 50, timeout=30,
                   interval=0.0005, what="the copy to be under way")
        remove_partial_copies(disk)

    cleaner = threading.Thread(target=peer_starts)
    cleaner.start()
    try:
        persist(memory, disk, 8)
    except PersistError:
        pass  # a copy undone is tried again; the disk tier must be as it was
    cleaner.join()
    if read_tracker(disk) is None:
        assert list_iterations(disk) == []
    else:
        target = iteration_dir(disk, 8)
        assert size_problem(target, read_manifest(target)) is None


def test_a_copy_whose_folder_is_taken_away_before_its_manifest_lands_nothing(tmp_path,
                                                                             monkeypatch):
    """Removed after its last file and before the manifest (a peer node's ftmaster starting),
    the folder was made again around the manifest alone, renamed into place and tracked."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 8)
    copy_file = persist_module._copy_verified
    left = len(read_manifest(iteration_dir(memory, 8)).files)

    def copy_then_lose_the_folder(source, target, expected):
        nonlocal left
        copy_file(source, target, expected)
        left -= 1
        if left == 0:
            remove_partial_copies(disk)

    monkeypatch.setattr(persist_module, "_copy_verified", copy_then_lose_the_folder)
    with pytest.raises(PersistError):
        persist(memory, disk, 8)
    assert read_tracker(disk) is None and list_iterations(disk) == []


def test_the_persister_copies_in_the_background_and_pins_what_it_reads(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 6)
    persister = Persister(memory, disk)
    assert persister.newest_memory_checkpoint() == 6 and persister.needs_copy(6)
    assert persister.start(6)
    persister.wait(30)
    (result,) = persister.take_results()
    assert result.iteration == 6 and read_tracker(disk) == 6
    assert not persister.needs_copy(6)
    assert not (memory / ".ftmaster_persisting").exists()  # unpinned when done


@pytest.mark.parametrize("told_by", ["a poll", "the load"])
def test_an_iteration_saved_again_after_a_discarded_timeline_is_copied_again(tmp_path, told_by):
    """Memory and disk 6 set aside by a resume from 4, then a new iteration 6: it was never
    copied, since 6 was the iteration copied last, and disk stayed at 4 until the next. A
    resume from disk leaves the memory tier no checkpoint, and its tracker none: no poll
    sees 4 there, and only the attempt's load tells."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 6)
    persister = Persister(memory, disk)
    assert persister.start(6)
    persister.wait(30)
    persister.take_results()
    for tier in (memory, disk):  # what set_aside_newer does for a resume from 4
        iteration_dir(tier, 6).rename(tier / "iter_0000006.discarded-1")
        tracker_path(tier).write_text("4")
    if told_by == "a poll":
        persister.may_need_copy(4)  # the tier's newest is the one resumed from
    else:
        tracker_path(memory).unlink()
        persister.may_need_copy(None)
        persister.resumed_from(4)
    fake_checkpoint(memory, 6)
    assert persister.needs_copy(6)


def test_a_pin_a_killed_ftmaster_left_is_let_go_when_the_next_one_starts(tmp_path):
    """Its checkpoint was kept from pruning and slot refills, in /dev/shm, until the new
    run's first copy (for good when none was ever due)."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    for iteration in (2, 4):
        fake_checkpoint(memory, iteration)
    assert pin(memory, 2)  # the killed ftmaster was copying it
    Persister(memory, disk)
    assert prunable_memory_checkpoints(memory, 4) == [2]


def test_a_checkpoint_pruned_before_it_is_pinned_is_not_copied(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 6)
    persister = Persister(memory, disk)
    shutil.rmtree(iteration_dir(memory, 6))  # the trainer's pruning got there first
    assert not persister.start(6) and persister.last_requested is None
    assert not (memory / ".ftmaster_persisting").exists()


def test_a_full_memory_tier_that_cannot_take_the_pin_is_a_failed_copy_not_a_dead_supervisor(
        tmp_path, monkeypatch):
    """The pin is a few bytes written into the memory folder: a full /dev/shm refuses them."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 6)
    persister = Persister(memory, disk)

    def full(path, text, durable=True):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("ftmaster.recovery.checkpoints.atomic_write_text", full)
    assert not persister.start(6) and not persister.busy
    (failure,) = persister.take_results()
    assert isinstance(failure, PersistError) and "No space left" in str(failure)
    assert not persister.needs_copy(6)  # waits before it is tried again, as a failed copy
    monkeypatch.undo()
    first_retry_wait_passed(persister)
    assert persister.needs_copy(6, retry_now=True) and persister.start(6)
    persister.wait(30)
    assert persister.take_results()[0].iteration == 6 and read_tracker(disk) == 6


def test_a_failed_copy_is_tried_again(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    source = fake_checkpoint(memory, 6)
    good = (source / "common.pt").read_bytes()
    (source / "common.pt").write_bytes(b"x" * len(good))
    persister = Persister(memory, disk)
    assert persister.start(6)
    persister.wait(30)
    assert isinstance(persister.take_results()[0], PersistError)
    first_retry_wait_passed(persister)
    assert persister.needs_copy(6, retry_now=True)  # not given up on: the end of the run tries again
    (source / "common.pt").write_bytes(good)
    assert persister.start(6)
    persister.wait(30)
    assert persister.take_results()[0].iteration == 6 and read_tracker(disk) == 6


def test_a_copy_whose_peers_pruned_the_checkpoint_is_not_tried_again_but_a_newer_one_is(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    (fake_checkpoint(memory, 6) / "__0_0.distcp").unlink()  # held by a peer only

    def pruned(name, dest, expected):
        raise PeerMissing(f"{name}: no live holder serves it (404 no such file)")

    persister = Persister(memory, disk)
    assert persister.start(6, pruned)
    persister.wait(30)
    (result,) = persister.take_results()
    assert isinstance(result, PersistSuperseded) and "no longer held by the peers" in str(result)
    assert not persister.needs_copy(6) and persister.needs_copy(8)
    assert read_tracker(disk) is None


def test_a_copy_killed_after_its_rename_moves_the_tracker_on_the_next_try(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 8)
    fake_checkpoint(disk, 4, kind="periodic")
    fake_checkpoint(disk, 8)
    tracker_path(disk).write_text("4\n")  # the rename happened, the tracker move did not
    assert persist(memory, disk, 8) is None and read_tracker(disk) == 8


def test_a_copy_whose_tracker_cannot_be_written_leaves_the_disk_tier_as_it_was(
        tmp_path, monkeypatch):
    """A --save that fills up as the tracker moves: the copy failed (persist_failed), yet
    its folder stayed in place, untracked, holding the room the next saves lacked; and the
    next try only moved the tracker, so no event ever said the checkpoint was on disk."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 6)

    def full(path, text, durable=True):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("ftmaster.recovery.checkpoints.atomic_write_text", full)
    with pytest.raises(PersistError, match="No space left"):
        persist(memory, disk, 6)
    assert list_iterations(disk) == [] and not list(disk.glob(".iter_*"))
    monkeypatch.undo()
    assert persist(memory, disk, 6).iteration == 6 and read_tracker(disk) == 6


@pytest.mark.parametrize("code, locks", [(errno.ENOLCK, False), (errno.ENOSYS, False),
                                         (errno.EIO, True)])
def test_a_filesystem_without_locks_still_moves_trackers(tmp_path, monkeypatch, code, locks):
    """Lustre's noflock and NFS without lockd refuse flock; that must not fail every save."""
    def refuse(fd, operation):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fcntl, "flock", refuse)
    if locks:
        with pytest.raises(OSError):
            advance_tracker(tmp_path, 4)
    else:
        assert advance_tracker(tmp_path, 4) and read_tracker(tmp_path) == 4


def test_memory_pruning_removes_what_a_resume_set_aside(tmp_path):
    memory = tmp_path / "memory"
    for iteration in (2, 4, 6):
        fake_checkpoint(memory, iteration)
    discarded = iteration_dir(memory, 8).with_name("iter_0000008.discarded-x")
    discarded.mkdir()
    prune_memory_checkpoints(memory, 6, set())
    assert list_iterations(memory) == [6] and not discarded.exists()


def test_pruning_keeps_the_newest_the_pinned_the_whole_and_the_tracked(tmp_path):
    memory = tmp_path / "memory"
    for iteration in (1, 2, 4, 6, 8):
        fake_checkpoint(memory, iteration)
    pin(memory, 4)
    assert mark_whole(memory, 2)
    tracker_path(memory).write_text("6\n")
    assert prunable_memory_checkpoints(memory, 8) == [1]


def test_a_full_tier_prunes_a_tracked_memory_checkpoint_a_disk_one_supersedes(tmp_path):
    """A memory save that did not fit went to disk: the memory tier's tracked checkpoint is
    older than that one (a load takes the disk one first), and kept, it held the room every
    later memory save lacked, for good (relaunches included). Pinned or whole ones stay."""
    memory = tmp_path / "memory"
    for iteration in (2, 4, 6):
        fake_checkpoint(memory, iteration)
    pin(memory, 2)
    prune_memory_checkpoints(memory, 8, set(), superseded_below=8)
    assert list_iterations(memory) == [2] and read_tracker(memory) is None
    fake_checkpoint(memory, 10)
    prune_memory_checkpoints(memory, 12, set(), superseded_below=8)
    assert list_iterations(memory) == [10, 2] and read_tracker(memory) == 10


def test_candidates_come_from_both_tiers_newest_first_memory_on_a_tie(tmp_path):
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    for iteration in (4, 8):
        fake_checkpoint(disk, iteration, kind="periodic")
    for iteration in (8, 10):
        fake_checkpoint(memory, iteration)
    found = tier_candidates(disk, memory)
    assert [(c.iteration, c.tier) for c in found.candidates] == [
        (10, "memory"), (8, "memory"), (8, "disk"), (4, "disk")]
    assert [(c.iteration, c.tier) for c in tier_candidates(disk, None).candidates] == [
        (8, "disk"), (4, "disk")]


@pytest.mark.parametrize("args, tiers", [
    (["--save", "S", "--non-persistent-ckpt-type", "global"], Tiers(Path("S/non_persistent"), Path("S"))),
    (["--save", "S", "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", "M"],
     Tiers(Path("M"), Path("S"))),
    (["--save", "S"], None),
])
def test_the_tiers_of_a_command_are_the_trainers(args, tiers):
    assert tiers_of(args) == tiers


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "100", "--micro-batch-size", "1",
         "--non-persistent-ckpt-type", "global"]


def test_ftmaster_puts_the_memory_tier_in_dev_shm_when_three_checkpoints_fit(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    args, note = with_memory_dir(MODEL + ["--save", str(tmp_path / "save")], tmp_path / "run", shm)
    folder = args[args.index("--non-persistent-global-ckpt-dir") + 1]
    assert folder.startswith(str(shm / "ftmaster-run-")) and note == f"memory tier in {folder}"
    again, _ = with_memory_dir(MODEL + ["--save", str(tmp_path / "save")], tmp_path / "run", shm)
    assert again == args  # the same folder for the same run directory (a restarted ftmaster)


@pytest.mark.parametrize("made_by_another", ["writable by others", "a symlink"])
def test_a_memory_folder_another_user_could_have_made_is_not_taken(tmp_path, made_by_another):
    """The folder's name is known in advance: one made there by another user (world-writable,
    or a symlink to a folder of theirs) was taken as the run's own, and its checkpoints loaded
    and persisted as this run's."""
    shm = tmp_path / "shm"
    shm.mkdir()
    args = MODEL + ["--save", str(tmp_path / "save")]
    ours = Path(flag_value(with_memory_dir(args, tmp_path / "run", shm)[0],
                           "--non-persistent-global-ckpt-dir"))
    if made_by_another == "a symlink":
        (tmp_path / "theirs").mkdir()
        ours.symlink_to(tmp_path / "theirs")
    else:
        ours.mkdir()
        ours.chmod(0o777)
    chosen, note = with_memory_dir(args, tmp_path / "run", shm)
    assert chosen == args  # under --save
    assert note.startswith("warning: ") and f"{ours} exists and is not this user's alone" in note


def test_across_nodes_each_node_gets_a_memory_folder_of_its_own(tmp_path):
    """Two nodes on one host (loopback tests, or two containers sharing /dev/shm) never share
    one; a node that restarts finds its own again."""
    shm = tmp_path / "shm"
    shm.mkdir()
    args = MODEL + ["--save", str(tmp_path / "save")]
    folders = [flag_value(with_memory_dir(args, tmp_path / "run", shm, node_rank=r)[0],
                          "--non-persistent-global-ckpt-dir") for r in (0, 1, 0)]
    assert folders[0] == folders[2] != folders[1]
    assert [Path(f).name.rsplit("-", 1)[0] for f in folders[:2]] == ["ftmaster-run-node0",
                                                                      "ftmaster-run-node1"]


def test_without_room_the_memory_tier_stays_under_save(tmp_path, monkeypatch):
    """The free space is the edge here (a container's /dev/shm is 64 MB by default)."""
    save = tmp_path / "save"
    fake_checkpoint(save, 3, shard_bytes=40_000_000, kind="periodic")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 64_000_000))
    args, note = with_memory_dir(MODEL + ["--save", str(save)], tmp_path / "run", tmp_path)
    assert "--non-persistent-global-ckpt-dir" not in args
    assert "0.06 GB free, 3 checkpoints and 10% of one to spare need about 0.12 GB" in note


def test_a_restarted_ftmaster_keeps_the_runs_memory_folder_whatever_the_room(tmp_path, monkeypatch):
    """Its newest checkpoints may be there alone, and they fill part of the room counted."""
    save, shm = tmp_path / "save", tmp_path / "shm"
    shm.mkdir()
    fake_checkpoint(save, 3, shard_bytes=40_000_000, kind="periodic")
    first, _ = with_memory_dir(MODEL + ["--save", str(save)], tmp_path / "run", shm)
    folder = Path(flag_value(first, "--non-persistent-global-ckpt-dir"))
    folder.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 64_000_000))
    again, note = with_memory_dir(MODEL + ["--save", str(save)], tmp_path / "run", shm)
    assert again == first and note == f"memory tier in {folder} (the run's own)"
    other_run, _ = with_memory_dir(MODEL + ["--save", str(save)], tmp_path / "other", shm)
    assert "--non-persistent-global-ckpt-dir" not in other_run  # no room for a new one


def test_a_given_memory_folder_is_kept(tmp_path):
    args = MODEL + ["--save", "S", "--non-persistent-global-ckpt-dir", "M"]
    assert with_memory_dir(args, tmp_path, tmp_path) == (args, None)


def test_a_tokenizer_files_vocabulary_is_assumed_and_an_unknown_size_keeps_dev_shm_out(tmp_path):
    from_tokenizer = [a for a in MODEL if a not in ("--vocab-size", "100")] + ["--save", "S"]
    assert checkpoint_bytes_guess(from_tokenizer) > checkpoint_bytes_guess(MODEL + ["--save", "S"])
    args, note = with_memory_dir(["--non-persistent-ckpt-type", "global", "--save", "S"],
                                 tmp_path / "run", tmp_path)
    assert "--non-persistent-global-ckpt-dir" not in args
    assert "the size of a checkpoint is unknown" in note


def test_a_resume_sets_aside_newer_checkpoints_but_removes_a_save_killed_at_its_mkdir(tmp_path):
    """A save killed right after its mkdir leaves an empty iter_* folder: nothing to keep, so
    it is removed rather than kept forever as iter_*.discarded-<time>."""
    save = tmp_path / "save"
    fake_checkpoint(save, 6)
    newer = fake_checkpoint(save, 9)
    iteration_dir(save, 12).mkdir()  # killed at its mkdir
    (iteration_dir(save, 15) / "sub").mkdir(parents=True)  # or with its first subfolder
    moved = dict(set_aside_newer(save, 6))
    assert moved[iteration_dir(save, 12)] is None and moved[iteration_dir(save, 15)] is None
    assert moved[newer].name.startswith("iter_0000009.discarded-") and moved[newer].is_dir()
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000006", moved[newer].name]
    assert read_tracker(save) == 6


def test_a_resume_removes_newer_saves_killed_mid_write_and_keeps_complete_or_legacy_ones(tmp_path):
    """A rank killed during an async (or emergency) save leaves its iter_* folder with some
    shards and their .digest sidecars but no .metadata and no manifest: never loadable, so it
    is removed, not kept forever as iter_*.discarded-<time> (one per failure, as big as a
    checkpoint). A folder with every file a load needs but no manifest (a checkpoint from
    before the manifests) is still set aside."""
    save = tmp_path / "save"
    fake_checkpoint(save, 6)
    complete = fake_checkpoint(save, 9)
    killed = iteration_dir(save, 12)
    killed.mkdir()
    for name in ("__0_0.distcp", "__0_0.distcp.digest", "__1_0.distcp", "common.pt"):
        (killed / name).write_bytes(b"x" * 100)
    legacy = iteration_dir(save, 15)
    legacy.mkdir()
    for name in ("__0_0.distcp", "common.pt", ".metadata", "metadata.json"):
        (legacy / name).write_bytes(b"x" * 100)
    megatron_legacy = iteration_dir(save, 18)  # Megatron-LM's torch format: not ours to judge
    (megatron_legacy / "mp_rank_00").mkdir(parents=True)
    (megatron_legacy / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x" * 100)
    foreign = iteration_dir(save, 21)  # some other tool's files
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"x" * 100)
    moved = dict(set_aside_newer(save, 6))
    assert moved[killed] is None and not killed.exists()
    for kept, iteration in ((complete, 9), (legacy, 15), (megatron_legacy, 18), (foreign, 21)):
        assert moved[kept].name.startswith(f"iter_{iteration:07d}.discarded-") and moved[kept].is_dir()
    assert len([p for p in save.iterdir() if p.name.startswith("iter_")]) == 5
    assert read_tracker(save) == 6


def test_a_resume_from_memory_never_leaves_the_disk_tracker_on_a_killed_saves_folder(tmp_path):
    """Resumed from memory checkpoint 8, the disk tier had a newer 9 (set aside) and a save
    of 8 killed mid-write: its tracker went back to 8, so the disk counted 8 as persisted
    (no copy was made, and the end of the run removed the memory tier holding 8 alone)."""
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 8)
    fake_checkpoint(disk, 6)
    fake_checkpoint(disk, 9)
    killed = iteration_dir(disk, 8)
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"x" * 100)
    moved = dict(set_aside_newer(disk, 8, resumed_here=False))
    assert moved[killed] is None and not killed.exists()
    assert newest_on_disk(disk) == 6
    assert persist(memory, disk, 8).iteration == 8 and read_tracker(disk) == 8
    assert set_aside_newer(memory, 8) == [] and is_complete(iteration_dir(memory, 8))


def rmtree_that_fails(monkeypatch) -> None:
    """``shutil.rmtree`` as on a folder it cannot empty (a permission, a busy NFS file): with
    ignore_errors it removes nothing and says nothing."""
    def failing(path, ignore_errors=False, onerror=None):
        if not ignore_errors:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(shutil, "rmtree", failing)


def killed_save(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    return folder


def test_a_killed_save_that_cannot_be_removed_is_set_aside_not_reported_removed(
        tmp_path, monkeypatch, capsys):
    """A resume removing what a killed save left reported it removed (console line and a
    checkpoint_set_aside event with moved_to None) when rmtree could not, and left it under
    its name: in the resumed tier, a newer iter_* folder of a discarded timeline; in the
    other tier, the resumed iteration's folder, which the tracker was then moved back to."""
    disk = tmp_path / "disk"
    fake_checkpoint(disk, 6)
    fake_checkpoint(disk, 9)
    newer, same = killed_save(iteration_dir(disk, 12)), killed_save(iteration_dir(disk, 8))
    rmtree_that_fails(monkeypatch)
    moved = dict(set_aside_newer(disk, 8, resumed_here=False))
    for folder in (newer, same):
        assert moved[folder].name.startswith(f"{folder.name}.discarded-")
        assert moved[folder].is_dir() and not folder.exists()
    assert "removed /" not in capsys.readouterr().out
    assert list_iterations(disk) == [6] and read_tracker(disk) is None


def test_a_fresh_start_sets_aside_a_killed_save_it_cannot_remove(tmp_path, monkeypatch, capsys):
    save = tmp_path / "save"
    killed = killed_save(iteration_dir(save, 10))
    rmtree_that_fails(monkeypatch)
    prepare_fresh_start(str(save))
    assert not killed.exists() and list_iterations(save) == []
    assert [p.name.startswith("iter_0000010.discarded-") for p in save.iterdir()] == [True]
    assert f"removed {killed}" not in capsys.readouterr().out


def test_a_fresh_start_over_a_killed_save_it_can_neither_remove_nor_rename_is_refused(
        tmp_path, monkeypatch):
    save = tmp_path / "save"
    killed = killed_save(iteration_dir(save, 10))
    rmtree_that_fails(monkeypatch)
    def rename(path, _target):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(CheckpointMismatch, match=r"iter_0000010, a save that never finished, can "
                       r"be neither removed nor renamed \(EACCES \(Permission denied\) on "):
        prepare_fresh_start(str(save))
    assert killed.is_dir()


def test_a_fresh_start_removes_only_what_a_killed_save_of_ours_left(tmp_path):
    """Without a tracker a folder lacking a manifest is no candidate, but only a killed save's
    leftovers may go: a Megatron-LM checkpoint copied in without its tracker, another tool's
    folder or one whose .metadata landed were removed by a run that started fresh over them."""
    save = tmp_path / "save"
    killed = iteration_dir(save, 10)
    killed.mkdir(parents=True)
    for name in ("__0_0.distcp", "__0_0.distcp.digest", "common.pt"):
        (killed / name).write_bytes(b"x" * 100)
    empty = iteration_dir(save, 20)
    empty.mkdir()
    legacy = iteration_dir(save, 30) / "mp_rank_00" / "model_optim_rng.pt"
    foreign = iteration_dir(save, 40) / "model.safetensors"
    whole = iteration_dir(save, 50) / ".metadata"
    for kept in (legacy, foreign, whole):
        kept.parent.mkdir(parents=True)
        kept.write_bytes(b"x" * 100)
    (whole.parent / "__0_0.distcp").write_bytes(b"x" * 100)
    prepare_fresh_start(str(save))
    assert not killed.exists() and not empty.exists()
    assert all(kept.read_bytes() == b"x" * 100 for kept in (legacy, foreign, whole))


def left_memory_tier(shm: Path, name: str, save: Path, run_dir: Path, iteration: int) -> Path:
    """What a run on ``save`` with a memory folder ftmaster picked leaves when its ftmaster
    is killed: its checkpoint of ``iteration``, the folder's owner record, its run directory."""
    folder = shm / name
    fake_checkpoint(folder, iteration)
    mark_owner(folder, save, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return folder


def test_a_relaunch_under_another_run_directory_persists_what_a_killed_run_left_in_memory(tmp_path):
    """ftmaster SIGKILLed with the memory tier ahead of disk (1055 against 1000 in the sweep's
    reproduction), relaunched without --run-dir (a new timestamped one): the memory folder of
    the old run was neither resumed from nor removed. Now its newest checkpoint reaches
    --save before training loads, and the folder is freed; others' are left alone."""
    shm, save = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(save, 6)
    own = shm / "ftmaster-new-1"
    mark_owner(own, save, tmp_path / "new-run")
    left = left_memory_tier(shm, "ftmaster-old-2", save, tmp_path / "old-run", 9)
    behind = left_memory_tier(shm, "ftmaster-older-3", save, tmp_path / "older-run", 4)
    other_save = left_memory_tier(shm, "ftmaster-other-4", tmp_path / "other", tmp_path / "o", 12)
    live = left_memory_tier(shm, "ftmaster-live-5", save, tmp_path / "live-run", 11)
    unseen = left_memory_tier(shm, "ftmaster-unseen-6", save, tmp_path / "gone-run", 13)
    shutil.rmtree(tmp_path / "gone-run")  # a run directory this host does not see: unknown
    shared = left_memory_tier(shm, "ftmaster-shared-7", save, tmp_path / "shared-run", 14)
    shared.chmod(0o777)  # anyone may write it: not trusted
    lines = []
    with RunDirLock(tmp_path / "live-run"):
        assert persist_left_behind(own, save, True, lines.append, shm) == 2
    assert read_tracker(save) == 9 and is_complete(iteration_dir(save, 9))
    assert not left.exists() and not behind.exists()  # 4 is on disk's side already
    assert all(folder.exists() for folder in (other_save, live, own, unseen, shared))
    persisting, persisted, removed_left, removed_behind, unseen_left = lines
    assert persisting.startswith(f"persisting iteration 9 to {save} before training starts: {left}")
    assert persisted.startswith("persisted iteration 9: ")
    assert removed_left == f"removed {left}: the memory tier a stopped run on this --save left"
    assert removed_behind.startswith(f"removed {behind}: ")
    assert unseen_left.startswith(f"warning: {unseen}, ")  # left alone, but not unsaid


def test_a_memory_tier_whose_run_directory_is_not_seen_is_left_alone_but_named(tmp_path):
    """A folder on this --save whose run directory is gone (or not seen from this host) may
    be a live run's, so it is not taken over; it was skipped without a word, though it holds
    node memory and here a checkpoint newer than disk's, which the relaunch does not resume."""
    shm, save = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(save, 6)
    unseen = left_memory_tier(shm, "ftmaster-unseen-6", save, tmp_path / "gone-run", 13)
    behind = left_memory_tier(shm, "ftmaster-behind-7", save, tmp_path / "gone-too", 4)
    shutil.rmtree(tmp_path / "gone-run")
    shutil.rmtree(tmp_path / "gone-too")
    lines = []
    assert persist_left_behind(None, save, True, lines.append, shm) == 0
    assert unseen.exists() and behind.exists() and read_tracker(save) == 6
    older, newer = lines
    assert older == (f"warning: {behind}, a memory tier on this --save, is left alone: its run "
                     f"directory {tmp_path / 'gone-too'} is not seen here (remove the folder "
                     f"once no run uses it, to free its memory)")
    assert newer == (f"warning: {unseen}, a memory tier on this --save, is left alone: its run "
                     f"directory {tmp_path / 'gone-run'} is not seen here (remove the folder "
                     f"once no run uses it, to free its memory); it holds iteration 13, newer "
                     f"than disk's 6")


def test_a_left_memory_tier_whose_newest_cannot_be_persisted_gives_the_resume_its_next_one(
        tmp_path):
    """The stopped run's two slots, both newer than disk, the newest damaged in memory: the
    take-over gave up on the folder, and the relaunch resumed from disk's older checkpoint,
    though the other slot's persisted fine. The folder stays: its newest is not on disk."""
    shm, save = tmp_path / "shm", tmp_path / "ckpt"
    fake_checkpoint(save, 6)
    left = left_memory_tier(shm, "ftmaster-old-2", save, tmp_path / "old-run", 8)
    (fake_checkpoint(left, 9) / "__0_0.distcp").write_bytes(b"torn")
    lines = []
    assert persist_left_behind(None, save, True, lines.append, shm) == 0
    assert read_tracker(save) == 8 and is_complete(iteration_dir(save, 8))
    assert is_complete(iteration_dir(left, 9))
    assert lines[-1] == (f"warning: {left} is left in place: its iteration 9 could not be "
                         f"persisted, and is newer than disk's 8")


def test_a_fresh_start_on_the_same_save_leaves_a_newer_memory_tier_in_place_and_says_so(tmp_path):
    """Without --load the run starts fresh: persisting would give --save checkpoints, and a
    fresh start refuses such a --save. The folder stays, and the warning says how to resume."""
    shm, save = tmp_path / "shm", tmp_path / "ckpt"
    left = left_memory_tier(shm, "ftmaster-old-2", save, tmp_path / "old-run", 9)
    lines = []
    assert persist_left_behind(None, save, False, lines.append, shm) == 0
    assert left.exists() and read_tracker(save) is None
    (warning,) = lines
    assert warning.startswith(f"warning: {left}, the memory tier a stopped run on this --save "
                              f"left, holds iteration 9, newer than disk's None: give --load {save}")


def test_a_save_folder_this_user_cannot_list_is_sized_from_the_model(monkeypatch):
    """Listing it raised PermissionError out of the launch's set-up, a traceback before the
    --save claim that refuses it in one line."""
    def unlistable(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    from_shape = checkpoint_bytes_guess(MODEL + ["--save", "S"])
    monkeypatch.setattr("ftmaster.persist.list_iterations", unlistable)
    assert checkpoint_bytes_guess(MODEL + ["--save", "S"]) == from_shape


def test_an_incomplete_folder_of_the_iteration_on_disk_fails_the_copy_before_it_copies(
        tmp_path, monkeypatch):
    """A save killed between its .metadata and its manifest left iter_N on disk: every try,
    5 s apart and doubling, copied the whole checkpoint to the parallel file system and then
    failed with 'iter_N appeared while the copy was made'."""
    from ftmaster import persist as persist_module

    memory, disk = tmp_path / "memory", tmp_path / "disk"
    fake_checkpoint(memory, 8)
    torn = iteration_dir(disk, 8)
    torn.mkdir(parents=True)
    (torn / ".metadata").write_bytes(b"x")
    monkeypatch.setattr(persist_module, "_copy_verified",
                        lambda *args: pytest.fail("copied into a folder that cannot land"))
    with pytest.raises(PersistError, match="iter_0000008 exists and is not a complete checkpoint"):
        persist(memory, disk, 8)
    assert os.listdir(disk) == ["iter_0000008"]


def test_a_persisted_copy_is_dated_when_training_wrote_it_not_when_it_was_copied(tmp_path):
    """The supervisor's hang check reads the newest checkpoint's time in --save as training
    writing one: a copy landed by ftmaster while the trainer hung, dated now, put the hang
    off by a whole --hang-timeout."""
    from ftmaster.recovery.checkpoints import folder_written_at

    source = fake_checkpoint(tmp_path / "shm", 8)
    an_hour_ago = time.time() - 3600
    for entry in (*source.iterdir(), source):
        os.utime(entry, (an_hour_ago, an_hour_ago))
    copied = persist(tmp_path / "shm", tmp_path / "ckpt", 8)
    assert copied is not None and read_tracker(tmp_path / "ckpt") == 8
    assert folder_written_at(copied.path) == pytest.approx(an_hour_ago, abs=1)
