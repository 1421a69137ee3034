"""Which survivors make a checkpoint (the pure cut choice), the merge's coverage check on
hand-made plans, and when the supervisor asks for a dump at all."""

import errno
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ftmaster.recovery.replicas import NoCut, Report, choose_cut
from ftmaster.replica_recovery import ReplicaRecovery
from megatron.training import rehearsal
from megatron.training.replica_merge import coverage_problem, optimizer_chunks


def report(rank, tp, pp, iteration, consumed=None, tp_size=1, pp_size=2, dp_size=2, items=None,
           refused=None):
    return Report(rank, tp, pp, rank % dp_size, tp_size, pp_size, dp_size, iteration,
                  consumed if consumed is not None else 8 * (iteration or 0),
                  items or {"w@0": "aa"}, refused=refused)


@pytest.mark.parametrize("reports, iteration, ranks", [
    # every survivor at 16: one per shard, the lowest rank
    ([report(0, 0, 0, 16), report(2, 0, 1, 16), report(3, 0, 1, 16)], 16, (0, 2)),
    # PP 1's survivors at 17 and 16: only 16 is complete for both shards
    ([report(0, 0, 0, 16), report(2, 0, 1, 17), report(3, 0, 1, 16)], 16, (0, 3)),
    # both shards reached 17 somewhere: the newest complete cut wins
    ([report(0, 0, 0, 17), report(1, 0, 0, 16), report(2, 0, 1, 16), report(3, 0, 1, 17)],
     17, (0, 3)),
    # a refusal is no survivor, but another replica covers its shard
    ([report(0, 0, 0, 16), report(1, 0, 0, None, refused="torn"), report(2, 0, 1, 16)], 16, (0, 2)),
])
def test_the_newest_complete_cut_one_survivor_per_shard(reports, iteration, ranks):
    cut = choose_cut(reports)
    assert (cut.iteration, cut.ranks, cut.consumed_samples) == (iteration, ranks, 8 * iteration)


@pytest.mark.parametrize("reports, message", [
    ([report(0, 0, 0, 16), report(1, 0, 0, 16)], r"shard \(TP 0, PP 1\) has no survivor"),
    ([report(0, 0, 0, 17), report(2, 0, 1, 16)], r"shard \(TP 0, PP 1\) has no survivor"),
    ([report(0, 0, 0, 16, dp_size=1), report(1, 1, 0, 16, tp_size=2, dp_size=1)],
     "the reports disagree on the layout"),
    ([report(0, 0, 0, 16, tp_size=2, dp_size=1), report(2, 0, 1, 16, tp_size=2, dp_size=1),
      report(3, 1, 1, 16, tp_size=2, dp_size=1)], r"DP 1: no shard has a replica"),
    # the same iteration, another data position: never mixed
    ([report(0, 0, 0, 16, consumed=128), report(2, 0, 1, 16, consumed=120)],
     "the survivors at iteration 16 disagree on the samples consumed"),
    ([report(0, 0, 0, 16), report(2, 0, 1, 16, items={"w@0": "aa"}),
      report(3, 0, 1, 16, items={"w@0": "bb"})], "differ .* one of them is corrupted"),
    ([report(0, 0, 0, None, refused="the dump failed: ENOSPC")], "no survivor dumped.*ENOSPC"),
    ([], "no survivor reported"),
])
def test_no_cut_says_why(reports, message):
    with pytest.raises(NoCut, match=message):
        choose_cut(reports)


def sharded(rank, iteration, items=None):
    """TP1 x PP1 x DP4, the distributed optimizer in two instances: ranks 0 and 1 hold its
    shards 0 and 1 in instance 0, ranks 2 and 3 again in instance 1."""
    return Report(rank, 0, 0, rank, 1, 1, 4, iteration, 8 * iteration, items or {"w@0": "aa"},
                  instance=rank // 2, optimizer_shard=rank % 2, optimizer_shards=2)


@pytest.mark.parametrize("reports, ranks", [
    ([sharded(0, 16), sharded(2, 16), sharded(3, 16)], (0, 3)),
    ([sharded(1, 16), sharded(2, 16)], (2, 1)),
    ([sharded(0, 16), sharded(1, 16), sharded(2, 16), sharded(3, 16)], (0, 1)),
])
def test_a_cut_takes_one_survivor_per_optimizer_shard_from_any_instance(reports, ranks):
    assert choose_cut(reports).ranks == ranks


def test_an_optimizer_shard_lost_in_every_instance_has_no_cut():
    with pytest.raises(NoCut, match=r"^shard \(TP 0, PP 0, optimizer shard 1\) has no survivor at "
                                    r"iteration 16, nor a complete cut at an earlier one$"):
        choose_cut([sharded(0, 16), sharded(2, 16)])


def test_the_replicas_of_an_optimizer_shard_must_agree():
    with pytest.raises(NoCut, match=r"optimizer shard 1\) at iteration 16 differ \(ranks 1 and 3"):
        choose_cut([sharded(0, 16), sharded(1, 16, {"s[0:4]": "aa"}),
                    sharded(3, 16, {"s[0:4]": "bb"})])


def _slice(fqn, start, end, values, sizes=(2, 4)):
    return {"fqn": fqn, "offsets": (0, 0), "sizes": sizes, "global_size": sizes, "start": start,
            "end": end, "values": torch.tensor(values, dtype=torch.float32)}


def test_optimizer_chunks_are_put_together_from_the_shards_slices():
    first = {"a[0:3]": _slice("a", 0, 3, [0, 1, 2])}
    second = {"a[3:8]": _slice("a", 3, 8, [3, 4, 5, 6, 7])}
    reports = {0: sharded(0, 16), 3: sharded(3, 16)}
    (chunk,) = optimizer_chunks({0: first, 3: second}, reports)
    assert (chunk.fqn, chunk.offsets, chunk.sizes) == ("a", (0, 0), (2, 4))
    assert torch.equal(chunk.values, torch.arange(8, dtype=torch.float32).reshape(2, 4))


@pytest.mark.parametrize("second, message", [
    ({"a[4:8]": _slice("a", 4, 8, [4, 5, 6, 7])}, r"a: the chunk at \[0, 0\] is not covered "
                                                   r"exactly once .*its first 3 of 8 elements"),
    ({"a[2:8]": _slice("a", 2, 8, [2, 3, 4, 5, 6, 7])}, "not covered exactly once"),
])
def test_optimizer_chunks_with_a_hole_or_an_overlap_refuse(second, message):
    first = {"a[0:3]": _slice("a", 0, 3, [0, 1, 2])}
    with pytest.raises(NoCut, match=message):
        optimizer_chunks({0: first, 3: second}, {0: sharded(0, 16), 3: sharded(3, 16)})


def test_a_slice_held_twice_is_taken_once_when_its_copies_agree():
    whole = {"a[0:8]": _slice("a", 0, 8, list(range(8)))}
    agreeing = {r: sharded(r, 16, {"a[0:8]": "aa"}) for r in (0, 1)}
    assert len(optimizer_chunks({0: whole, 1: whole}, agreeing)) == 1
    differing = {0: sharded(0, 16, {"a[0:8]": "aa"}), 1: sharded(1, 16, {"a[0:8]": "bb"})}
    with pytest.raises(NoCut, match=r"ranks 0 and 1 hold different copies of a\[0:8\]"):
        optimizer_chunks({0: whole, 1: whole}, differing)


def _tensor(size, *chunks):
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def _metadata(entries: dict) -> Metadata:
    storage = {}
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            storage.update({MetadataIndex(fqn, c.offsets): object() for c in entry.chunks})
        else:
            storage[MetadataIndex(fqn)] = object()
    return Metadata(entries, storage_data=storage)


@pytest.mark.parametrize("entries, problem", [
    ({"w": _tensor((4, 2), ((0, 0), (2, 2)), ((2, 0), (2, 2)))}, None),
    ({"w": _tensor((4, 2), ((0, 0), (2, 2)))}, "w: 4 of its 8 elements are covered"),
    ({"w": _tensor((4, 2), ((0, 0), (3, 2)), ((2, 0), (2, 2)))}, "overlap"),
    ({"w": _tensor((4, 2), ((0, 0), (2, 2)), ((3, 0), (2, 2)))}, "lies outside"),
    ({"w": _tensor((4, 2))}, "w: 0 of its 8 elements are covered"),
    ({"rng_state/shard_0.0_2.1": BytesStorageMetadata(),
      "rng_state/shard_1.0_2.1": BytesStorageMetadata()}, None),
    ({"rng_state/shard_0.0_2.1": BytesStorageMetadata()}, r"rng_state lacks its piece \(1, 0\)"),
])
def test_coverage_every_tensor_exactly_once_every_object_whole(entries, problem):
    found = coverage_problem(_metadata(entries))
    assert (found is None) == (problem is None), found
    assert problem is None or re.search(problem, found), found


def test_a_chunk_without_stored_bytes_is_a_hole():
    metadata = _metadata({"w": _tensor((2,), ((0,), (2,)))})
    metadata.storage_data.clear()
    assert coverage_problem(metadata) == "w: chunk at [0] has no stored bytes"


@pytest.mark.parametrize("cause, culprits, iteration, dp, expected", [
    ("device_lost", [1], 16, 2, None),
    ("exit", [1], 16, 2, None),
    ("hang", [1], 16, 2, None),  # a stopped rank: the others dump
    ("hang", [], 16, 2, "a hang with no known culprit"),
    ("device_lost", [1], 16, 1, "DP 1: no shard has a replica"),
    ("device_lost", [1], None, 2, ""),  # before the first iteration: nothing new to save
    ("nonfinite", [], 16, 2, ""),
    ("storage", [], 16, 2, ""),
])
def test_when_the_supervisor_asks_for_a_dump(tmp_path, cause, culprits, iteration, dp, expected):
    """None: it asks; "": no dump and nothing said; else the fallback line's reason."""
    said = []
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append(fields["reason"]))
    recovery.dump = lambda attempt, culprits, stop: "asked"
    asked = recovery.dump_if_useful(None, cause, culprits, iteration, dp)
    assert (asked == "asked") == (expected is None)
    assert said == [] if not expected else expected in said[0]


def test_a_dump_folder_that_cannot_be_made_is_a_fallback(tmp_path):
    """Its OSError raised out of the supervisor's failure handling (a memory tier that is a
    file, gone, or full), which ended ftmaster launch with a traceback."""
    from types import SimpleNamespace

    said = []
    (tmp_path / "memory").write_text("not a folder")
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append(fields["reason"]))
    attempt = SimpleNamespace(number=2, gpus=[0, 1], ranks=lambda: {})
    assert recovery.dump_if_useful(attempt, "device_lost", [1], 16, 2) is None
    assert len(said) == 1 and said[0].startswith("the dump could not be asked for: "), said


def test_a_merge_folder_a_killed_ftmaster_left_is_removed_when_the_next_one_starts(tmp_path):
    """Killed mid-merge, ftmaster left the half-built folder in the memory tier: hard links
    keeping the dumps' bytes in /dev/shm after the dumps were removed, and the optimizer
    state written into it. Only the next merge's end removed it, so each kill added one."""
    staging = tmp_path / "memory" / ".iter_0000016.replica-0a1b2c3d"
    staging.mkdir(parents=True)
    (staging / "optimizer.pt").write_bytes(b"state")
    ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save", lambda *a, **k: None)
    assert list((tmp_path / "memory").iterdir()) == []


def test_the_dump_does_not_wait_for_the_culprits_rank(tmp_path):
    """A hung rank is stopped and never answers: the dump waited out its whole timeout (20 s)."""
    from types import SimpleNamespace

    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save", lambda *a, **k: None)
    ended, alive = SimpleNamespace(exit_code=0), SimpleNamespace(exit_code=None)
    attempt = SimpleNamespace(gpus=[0, 3, 5], ranks=lambda: {0: ended, 1: alive, 2: ended})
    assert not recovery._all_answered(attempt, tmp_path, [])
    assert recovery._all_answered(attempt, tmp_path, [3])  # local rank 1 runs on GPU 3


def test_a_merge_that_crashed_says_why_in_the_fallback(tmp_path):
    """Its stderr was dropped: the fallback said only "exit status 1"."""

    from ftmaster.replica_recovery import Merging

    said = []
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append(fields["reason"]))
    crash = subprocess.Popen([sys.executable, "-c", "raise OSError('no room in /dev/shm')"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert recovery.finish_merge(Merging(tmp_path / "dumps", crash, 0.0), threading.Event()) is None
    assert "exit status 1: OSError: no room in /dev/shm" in said[0], said


def test_a_warm_merge_worker_that_ended_before_its_output_is_a_fallback(tmp_path):
    """Reading the output it never opened raised out of the supervisor."""
    from types import SimpleNamespace

    from ftmaster.replica_recovery import Merging

    said = []
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append(fields["reason"]))
    ended = SimpleNamespace(returncode=1, poll=lambda: 1, kill=lambda: None)
    merging = Merging(tmp_path / "dumps", ended, 0.0, tmp_path / "merge_1" / "output.log")
    assert recovery.finish_merge(merging, threading.Event()) is None
    assert said == ["the merge said nothing readable (list index out of range); exit status 1"]


def test_kill_points_arm_only_this_local_rank(monkeypatch):
    monkeypatch.setenv(rehearsal.KILL_ENV, "1:4:forward,0:5:update")
    rehearsal.arm_kill_points(1)
    assert set(rehearsal._armed_kills) == {(4, "forward")}
    monkeypatch.setenv(rehearsal.KILL_ENV, "1:4:backward")
    with pytest.raises(ValueError, match="POINT one of forward, grad-allreduce"):
        rehearsal.arm_kill_points(1)
    rehearsal._armed_kills.clear()


def test_the_merged_metadata_json_is_megatron_cores_own():
    from dataclasses import asdict

    from megatron.core.dist_checkpointing.core import CheckpointingConfig
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from megatron.training.replica_merge import CHECKPOINTING_CONFIG

    strategy = get_default_save_sharded_strategy("torch_dist")
    assert CHECKPOINTING_CONFIG == asdict(CheckpointingConfig(strategy.backend, strategy.version))


def test_a_dump_that_torch_dist_failed_to_write_is_reported_and_removed(tmp_path, monkeypatch):
    """torch raises a failed write as a CheckpointException, a BaseException: it escaped the
    dump thread with a traceback, no report was written (the fallback then blamed a missing
    survivor, after the whole dump timeout) and the partial dump kept the memory it filled."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ftmaster import runfiles
    from ftmaster.recovery.replicas import REQUEST_FLAG, rank_dump_dir, read_reports
    from megatron.training import replicas

    def write_dump(folder, sharded_state_dict, optimizer_slices=None):
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(bytes(4096))  # as far as the space went
        raise CheckpointException("", {0: (OSError(28, "No space left on device"), None)})

    monkeypatch.setattr(replicas, "write_dump", write_dump)
    monkeypatch.setattr(replicas, "layout_coordinates", lambda: {
        "rank": 0, "tp": 0, "pp": 0, "dp": 0, "tp_size": 1, "pp_size": 1, "dp_size": 2})
    state = type("State", (), {"iteration": 3, "consumed_train_samples": 24})()
    dumper = replicas.ReplicaDumper(tmp_path / "run", replicas.Cut(True), state, lambda *a: {})
    folder = tmp_path / "dumps"
    runfiles.write_flag(runfiles.flags_dir(tmp_path / "run") / REQUEST_FLAG, folder=str(folder))
    assert dumper.done.wait(10)
    (report,) = read_reports(folder)
    assert report.refused == "the dump failed: ENOSPC (No space left on device)"
    assert not rank_dump_dir(folder, 0).exists()


def test_a_dump_report_that_cannot_be_written_still_ends_the_parked_rank(tmp_path, monkeypatch, capsys):
    """The dump thread died before ``done``: the rank stayed parked its whole timeout, and the
    supervisor waited out its dump timeout (20 s) for a rank that would never answer."""
    from ftmaster import runfiles
    from ftmaster.recovery.replicas import REQUEST_FLAG
    from megatron.training import replicas

    monkeypatch.setattr(replicas, "layout_coordinates", lambda: {
        "rank": 0, "tp": 0, "pp": 0, "dp": 0, "tp_size": 1, "pp_size": 1, "dp_size": 2})
    state = type("State", (), {"iteration": 3, "consumed_train_samples": 24})()
    dumper = replicas.ReplicaDumper(tmp_path / "run", replicas.Cut(True), state, lambda *a: {},
                                    refusal="no replica here")
    folder = tmp_path / "dumps"
    folder.write_text("a file where the dump folder should be")
    runfiles.write_flag(runfiles.flags_dir(tmp_path / "run") / REQUEST_FLAG, folder=str(folder))
    assert dumper.done.wait(10)
    assert "rank 0's dump report could not be written" in capsys.readouterr().out


def test_a_merge_killed_mid_write_leaves_nothing_in_the_memory_tier(tmp_path):
    """Its checkpoint under construction (the chosen shards hard-linked) stayed for good, and
    with it the node memory of every shard it linked: removing the dumps freed none of it."""

    from ftmaster.replica_recovery import Merging

    memory = tmp_path / "memory"
    staging = memory / ".iter_0000016.replica-0123abcd"
    killed = subprocess.Popen(
        [sys.executable, "-c", "import os, pathlib, signal; p = pathlib.Path(os.sys.argv[1]); "
         "p.mkdir(parents=True); (p / '__0_0.distcp').write_bytes(bytes(64)); "
         "os.kill(os.getpid(), signal.SIGKILL)", str(staging)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = []
    recovery = ReplicaRecovery(tmp_path, memory, tmp_path / "save",
                               lambda name, **fields: said.append(fields["reason"]))
    assert recovery.finish_merge(Merging(tmp_path / "dumps", killed, 0.0), threading.Event()) is None
    assert "exit status -9" in said[0], said
    assert not staging.exists()


def test_a_warm_merge_never_answers_with_an_earlier_merges_output(tmp_path):
    """The worker appends to ``ranks/merge_<folder>/output.log``; a folder name seen before
    (across nodes, the round numbers restart in a requeued job) found the earlier merge's
    line there: the new merge was killed at once, and its recovery reported that old
    iteration as merged."""
    from types import SimpleNamespace

    said = []
    ended = SimpleNamespace(returncode=1, poll=lambda: 1, kill=lambda: None)
    starter = SimpleNamespace(run_module=lambda argv, folder: ended)
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append(fields.get("reason")), starter)
    folder = with_a_complete_cut(tmp_path / "memory" / "replicas" / "round_3")
    earlier = tmp_path / "ranks" / "merge_round_3" / "output.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"iteration": 16, "shards": 2, "seconds": 0.01, "path": "p", "bytes": 1}\n')
    stop = threading.Event()
    assert recovery.finish_merge(recovery.start_merge(folder, stop), stop) is None
    assert said == ["the merge said nothing readable (list index out of range); exit status 1"]


def with_a_complete_cut(folder: Path) -> Path:
    """``folder`` with the report of one rank that holds the whole state at iteration 16."""
    folder.mkdir(parents=True, exist_ok=True)
    dumped = {"rank": 0, "tp": 0, "pp": 0, "dp": 0, "tp_size": 1, "pp_size": 1, "dp_size": 2,
              "iteration": 16, "consumed_samples": 192, "items": {"w@0": "aa"}}
    (folder / "rank_0.json").write_text(json.dumps(dumped) + "\n")
    return folder


SUPERVISOR_THAT_MERGES = """
import sys, threading, time
from pathlib import Path
from ftmaster.replica_recovery import ReplicaRecovery
root = Path(sys.argv[1])
recovery = ReplicaRecovery(root, root / "memory", root / "save", lambda *a, **k: None)
print(recovery.start_merge(root / "dumps", threading.Event()).process.pid, flush=True)
time.sleep(60)
"""


def test_a_cold_merge_dies_with_a_killed_supervisor(tmp_path):
    """ftmaster SIGKILLed while a merge it started cold was importing torch: the merge lived
    on, an orphan writing a checkpoint into the memory tier under the next launch."""
    with_a_complete_cut(tmp_path / "dumps")  # outside the memory tier, which the start clears
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR_THAT_MERGES, str(tmp_path)],
                                  stdout=subprocess.PIPE, text=True)
    merge = psutil.Process(int(supervisor.stdout.readline()))
    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 1.0  # its import of torch alone takes longer
    while _alive(merge) and time.monotonic() < deadline:
        time.sleep(0.01)
    if _alive(merge):
        merge.kill()
        pytest.fail("the merge outlived the supervisor that started it")


def _alive(process) -> bool:
    """Running: a zombie nobody reaps (a container's init may not) is dead."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stop_signal_ends_the_wait_for_the_dumps_at_once(tmp_path):
    """ftmaster signalled while a survivor was still dumping (a large state, or a rank whose
    update holds the cut's lock) went on waiting up to the dump timeout (20 s) before it
    stopped. Now the wait ends, and no merge starts: the supervisor removes the dumps once the
    attempt is killed."""
    from types import SimpleNamespace

    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda *a, **k: None)
    (tmp_path / "flags").mkdir()
    attempt = SimpleNamespace(number=1, gpus=[0, 1], ranks=lambda: {0: SimpleNamespace(exit_code=None)})
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    assert recovery.dump_if_useful(attempt, "device_lost", [1], 16, 2, stop) is not None
    assert time.monotonic() - started < 2


def test_a_merge_that_cannot_start_falls_back_in_one_line(tmp_path, monkeypatch):
    """No process to be had right after every survivor copied its state into /dev/shm
    (ENOMEM, EAGAIN): the OSError ended the supervisor in a traceback, not in a relaunch from
    the newest checkpoint."""
    said = []
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append((name, fields["reason"])))
    folder = with_a_complete_cut(tmp_path / "memory" / "replicas" / "attempt_1")

    def no_process(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    assert recovery.start_merge(folder, threading.Event()) is None
    assert said == [("replica_fallback",
                     "the merge could not start: [Errno 12] Cannot allocate memory")]


def test_dumps_without_a_complete_cut_fall_back_without_starting_a_merge(tmp_path, monkeypatch):
    """Every survivor refused (the distributed optimizer in one instance), or a shard lost in
    all its replicas: the reports alone say there is no cut, yet a merge process was started
    to say so, its interpreter's start (2-5 s cold) added to the recovery before the fallback."""
    said = []
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append((name, fields["reason"])))
    folder = tmp_path / "memory" / "replicas" / "attempt_1"
    folder.mkdir(parents=True)
    refused = {"rank": 0, "tp": 0, "pp": 0, "dp": 0, "tp_size": 1, "pp_size": 1, "dp_size": 2,
               "refused": "replica recovery is unavailable: one instance"}
    (folder / "rank_0.json").write_text(json.dumps(refused) + "\n")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a merge was started"))
    assert recovery.start_merge(folder, threading.Event()) is None
    assert said == [("replica_fallback", "no survivor dumped its state "
                                         "(rank 0: replica recovery is unavailable: one instance)")]
    assert folder.exists()  # left for the caller to remove after the attempt's kill


def test_a_stop_during_the_dump_wait_says_no_fallback_and_starts_no_merge(tmp_path, monkeypatch):
    """The stop signal ends the wait for the dumps before every survivor has reported: the
    reports then showed no complete cut, and the run recorded a replica_fallback blaming the
    survivors ('no survivor reported'), when the stop alone had cut the wait short."""
    said = []
    recovery = ReplicaRecovery(tmp_path, tmp_path / "memory", tmp_path / "save",
                               lambda name, **fields: said.append((name, fields["reason"])))
    folder = tmp_path / "memory" / "replicas" / "attempt_1"
    folder.mkdir(parents=True)  # the stop came before any survivor's report
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a merge was started"))
    stop = threading.Event()
    stop.set()
    assert recovery.start_merge(folder, stop) is None
    assert said == []


@pytest.mark.parametrize("args, unavailable", [
    (["--replica-recovery", "--use-distributed-optimizer"], True),
    (["--replica-recovery", "--use-distributed-optimizer",
      "--num-distributed-optimizer-instances", "1"], True),
    (["--replica-recovery", "--use-distributed-optimizer",
      "--num-distributed-optimizer-instances", "2"], False),
    (["--replica-recovery", "--use-distributed-optimizer", "--no-use-distributed-optimizer"], False),
    (["--replica-recovery"], False),  # the trainer's default: off with one instance
    (["--use-distributed-optimizer"], False),
])
def test_launch_says_at_once_when_the_arguments_leave_replica_recovery_nothing_to_dump(
        args, unavailable):
    """The trainer's refusal came only in the failure's fallback, after the rehearsal it
    spoilt; the launch now logs the same line before the first attempt."""
    from ftmaster.replica_recovery import unavailable_in

    reason = unavailable_in(args)
    assert (reason is not None) is unavailable
    if unavailable:
        assert reason.startswith("replica recovery is unavailable") and "\n" not in reason
