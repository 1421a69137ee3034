"""No checkpoint is lost, corrupted or silently wrong: the real trainer (CPU + gloo) against a
garbage tracker, same-size corruption, a load that raises, a NaN loss and a full disk."""

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from ftmaster import runfiles
from ftmaster.recovery.checkpoints import iteration_dir, list_iterations, read_tracker, tracker_path
from ftmaster.recovery.manifest import MANIFEST_NAME, digest_problem, read_manifest
from helpers.trainer import SMALL_GPT, iterations, layout_args, run_trainer
from helpers.tmpfs import small_tmpfs

pytestmark = pytest.mark.slow

SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2",
            "--min-lr", "1e-4", "--lr-decay-style", "linear", "--seed", "5",
            "--override-opt-param-scheduler"]


def train(nproc, save, iters, *extra, run_dir=None, **env):
    args = SMALL_GPT + SCHEDULE + layout_args(1, nproc) + [
        "--train-iters", str(iters), "--save", str(save), "--save-interval", "2", *extra]
    if run_dir is not None:
        env["FTMASTER_RUN_DIR"] = str(run_dir)
    return run_trainer(nproc, args, **env)


def snapshot(save: Path) -> dict[str, bytes]:
    """Every file under ``save`` by relative path, with its bytes."""
    return {str(p.relative_to(save)): p.read_bytes() for p in sorted(save.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Six iterations at TP1 x PP2 with checkpoints at 2, 4 and 6, and the loss of each. The
    structure stays the same, so 4 and 6 keep the save plan of 2 (the tests below load them)."""
    root = tmp_path_factory.mktemp("trained")
    result = train(2, root / "save", 6, run_dir=root / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    assert list_iterations(root / "save") == [6, 4, 2] and read_tracker(root / "save") == 6
    saves = events(root / "run", "periodic_save")
    assert [(e["iteration"], e["structure"]) for e in saves] == [(2, "new"), (4, "same"), (6, "same")]
    return root / "save", iterations(result.stdout)


@pytest.fixture
def save(trained, tmp_path):
    copy = tmp_path / "save"
    shutil.copytree(trained[0], copy)
    return copy


def events(run_dir, name):
    return [e for e in runfiles.read_events(run_dir) if e["event"] == name]


def test_every_file_has_a_checksum_that_matches(trained):
    for iteration in (2, 4, 6):
        folder = iteration_dir(trained[0], iteration)
        manifest = read_manifest(folder)
        written = {p.name for p in folder.iterdir() if p.name != MANIFEST_NAME
                   and not p.name.endswith(".digest")}
        assert (manifest.kind, manifest.iteration) == ("periodic", iteration)
        assert set(manifest.files) == written
        shards = {name for name in written if name.endswith(".distcp")}
        assert set(manifest.items) == shards and all(manifest.items_cover(n) for n in shards)
        assert digest_problem(folder, manifest, sorted(manifest.files)) is None


def test_a_garbage_tracker_loads_the_newest_valid_checkpoint_and_changes_none(save, tmp_path):
    tracker_path(save).write_text("garbage")
    before = snapshot(save)
    result = train(1, save, 8, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "holds 'garbage', not an iteration: trying every iter_* folder" in result.stdout
    assert f"loaded checkpoint from {iteration_dir(save, 6)} at iteration 6" in result.stdout
    after = snapshot(save)
    assert {name: data for name, data in after.items() if name in before and
            name.startswith("iter_")} == {n: d for n, d in before.items() if n.startswith("iter_")}
    assert read_tracker(save) == 8 and list_iterations(save) == [8, 6, 4, 2]
    assert [e["iteration"] for e in events(tmp_path / "run", "checkpoint_loaded")] == [6]


def test_no_valid_checkpoint_stops_the_run_and_touches_nothing(save, tmp_path):
    tracker_path(save).write_text("garbage")
    for iteration in (2, 4, 6):
        (iteration_dir(save, iteration) / ".metadata").write_bytes(b"\x00broken")
    before = snapshot(save)
    result = train(1, save, 8, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode != 0
    assert f"error: no checkpoint in {save} can be loaded (iter_0000006: " in result.stdout
    assert snapshot(save) == before
    (failed,) = events(tmp_path / "run", "load_failed")
    assert failed["path"] == str(save)


def test_a_load_folder_whose_tracker_names_nothing_there_stops_the_run(tmp_path):
    """--load A --save B, A's tracker unreadable and no iter_* folder in A: the run started
    from random weights into B, where a bad tracker must never be a fresh start."""
    base, save = tmp_path / "base", tmp_path / "save"
    base.mkdir()
    tracker_path(base).write_text("garbage")
    result = train(1, save, 4, "--load", str(base), run_dir=tmp_path / "run")
    assert result.returncode != 0 and "(exitcode: 66)" in result.stdout, result.stdout[-3000:]
    assert (f"error: no checkpoint in {base} can be loaded ({tracker_path(base)} holds "
            "'garbage', not an iteration; no iter_* folder to fall back on)") in result.stdout
    assert not list_iterations(save) and not events(tmp_path / "run", "fresh_start")


def test_resharding_another_folders_checkpoint_into_save_writes_it_there(save, tmp_path):
    """--load A --save B --train-iters at A's iteration (a checkpoint resharded into B): the
    loaded checkpoint counted as already on disk, the final save wrote nothing, and the run
    ended 0 with B empty."""
    resharded = tmp_path / "resharded"
    result = train(1, resharded, 6, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    assert list_iterations(resharded) == [6] and read_tracker(resharded) == 6


def test_a_resume_at_another_global_batch_ends_at_train_iters(save, tmp_path):
    """Trained to 6 at batch 8, resumed at batch 16 with --train-iters 8: it went on to
    iteration 11 (the samples of 8 iterations at the new batch), where Megatron-LM and the
    supervisor's end of the schedule are iteration 8."""
    result = train(1, save, 8, "--load", str(save), "--global-batch-size", "16",
                   run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "training from iteration 6 to 8" in result.stdout
    assert read_tracker(save) == 8 and max(list_iterations(save)) == 8
    # the save at the schedule's end says so (the supervisor's end of it, --train-samples too)
    assert [(e["iteration"], e.get("ends_schedule")) for e in events(tmp_path / "run", "periodic_save")] \
        == [(8, True)]


def test_a_fresh_start_never_writes_over_checkpoints(save):
    before = snapshot(save)
    result = train(1, save, 8)
    assert result.returncode != 0
    assert (f"error: --save {save} already holds checkpoints (iter_0000006, iter_0000004, "
            f"iter_0000002) and none was loaded: pass --load {save}") in result.stdout
    assert snapshot(save) == before


def test_same_size_corruption_falls_back_to_the_previous_checkpoint(save, trained, tmp_path):
    shard = sorted(iteration_dir(save, 6).glob("*.distcp"))[1]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = os.urandom(4096)
    shard.write_bytes(bytes(data))
    result = train(1, save, 8, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    (skipped,) = events(tmp_path / "run", "checkpoint_skipped")
    assert skipped["iteration"] == 6 and f"{shard.name} checksum mismatch" in skipped["reason"]
    assert f"loaded checkpoint from {iteration_dir(save, 4)} at iteration 4" in result.stdout
    resumed = iterations(result.stdout)
    reference = trained[1]
    for it in (5, 6):  # the same trajectory as the run that wrote it, no NaN
        assert abs(resumed[it]["loss"] - reference[it]["loss"]) <= 0.02 * reference[it]["loss"]
    discarded = [p.name for p in save.iterdir() if p.name.startswith("iter_0000006.discarded-")]
    assert len(discarded) == 1  # the corrupt one is kept aside, not deleted


def test_a_metadata_unlike_its_manifest_falls_back_to_the_previous_checkpoint(save, tmp_path):
    """Checked where it is unpickled, before the load, not by a read of its own."""
    metadata = iteration_dir(save, 6) / ".metadata"
    data = metadata.read_bytes()
    metadata.write_bytes(data.replace(b"decoder", b"decodeR", 1))  # same size, still a pickle
    result = train(1, save, 8, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    (skipped,) = events(tmp_path / "run", "checkpoint_skipped")
    assert skipped["iteration"] == 6 and skipped["reason"].startswith(
        ".metadata checksum mismatch (xxh3_64 ")
    assert f"loaded checkpoint from {iteration_dir(save, 4)} at iteration 4" in result.stdout


def test_a_shard_the_manifest_does_not_list_falls_back_to_the_previous_checkpoint(save, tmp_path):
    manifest_path = iteration_dir(save, 6) / MANIFEST_NAME
    body = json.loads(manifest_path.read_text())
    shard = sorted(name for name in body["files"] if name.endswith(".distcp"))[1]
    del body["files"][shard], body["items"][shard]  # an incomplete manifest: nothing checks it
    manifest_path.write_text(json.dumps(body))
    result = train(1, save, 8, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    (skipped,) = events(tmp_path / "run", "checkpoint_skipped")
    assert skipped["iteration"] == 6 and skipped["reason"] == \
        f"shard {shard} is not in {MANIFEST_NAME}, so its checksum cannot be checked"
    assert f"loaded checkpoint from {iteration_dir(save, 4)} at iteration 4" in result.stdout


def test_a_load_that_raises_falls_back_even_without_checksums(save, tmp_path):
    folder = iteration_dir(save, 6)
    (folder / MANIFEST_NAME).write_text(json.dumps({"kind": "periodic"}))  # as before checksums
    common = folder / "common.pt"
    common.write_bytes(os.urandom(common.stat().st_size))
    result = train(1, save, 8, "--load", str(save), run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:]
    (skipped,) = events(tmp_path / "run", "checkpoint_skipped")
    assert skipped["iteration"] == 6 and skipped["reason"].startswith("common.pt: ")
    assert f"warning: {folder} has no checksummed manifest: its structure is checked" in result.stdout
    assert f"loaded checkpoint from {iteration_dir(save, 4)} at iteration 4" in result.stdout
    assert "Traceback" not in result.stdout


def test_a_nan_loss_stops_before_the_update_and_nothing_after_it_is_saved(tmp_path):
    save, run_dir = tmp_path / "save", tmp_path / "run"
    result = train(2, save, 8, run_dir=run_dir, FTMASTER_INJECT_NAN="1:5")
    assert result.returncode != 0
    assert "error: non-finite loss at iteration 5: the iteration was stopped before the " \
           "optimizer step; nothing was updated or saved" in result.stdout
    assert list_iterations(save) == [4, 2] and read_tracker(save) == 4
    assert [(e["iteration"], e["what"]) for e in events(run_dir, "nonfinite")] == [(5, "loss")]


def test_a_nan_gradient_on_a_first_stage_is_caught_too(tmp_path):
    save, run_dir = tmp_path / "save", tmp_path / "run"
    result = train(2, save, 6, run_dir=run_dir, FTMASTER_INJECT_NAN="0:3")
    assert result.returncode != 0
    assert [(e["iteration"], e["what"]) for e in events(run_dir, "nonfinite")] == [(3, "gradient norm")]
    assert read_tracker(save) == 2


def test_the_check_can_be_turned_off_as_in_megatron(tmp_path):
    result = train(1, tmp_path / "save", 4, "--no-check-for-nan-in-loss-and-grad",
                   FTMASTER_INJECT_NAN="0:3")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "iteration 4/4" in result.stdout and "lm loss: NAN |" in result.stdout


@pytest.fixture
def tiny_disk(tmp_path):
    """A tmpfs that holds two of these checkpoints and no more (root only)."""
    with small_tmpfs(tmp_path / "tiny", "7m") as folder:
        yield folder


def test_a_full_disk_fails_the_save_not_training_and_keeps_the_older_checkpoints(tiny_disk, tmp_path):
    save, run_dir = tiny_disk / "save", tmp_path / "run"
    result = train(2, save, 8, run_dir=run_dir)
    assert result.returncode != 0
    assert max(iterations(result.stdout)) == 8  # training went on past the failed saves
    failed = events(run_dir, "save_failed")
    assert failed and all("ENOSPC (No space left on device)" in e["reason"] for e in failed)
    assert {e["tier"] for e in failed} == {"disk"}
    assert "error: training ended at iteration 8 without its last checkpoint" in result.stdout
    tracked = read_tracker(save)
    assert tracked in (2, 4) and tracked == max(list_iterations(save))
    for iteration in list_iterations(save):  # what is left is whole
        manifest = read_manifest(iteration_dir(save, iteration))
        assert digest_problem(iteration_dir(save, iteration), manifest, sorted(manifest.files)) is None


def test_a_metadata_that_cannot_be_written_fails_that_save_on_every_rank_and_training_goes_on(tmp_path):
    """Rank 0 writes ``.metadata`` once every rank's writes are in; when it cannot (here a
    folder sits where it goes), the save fails as one, with its reason, and the
    ranks still meet in the same collectives: the next save succeeds.

    The folder is in ``.metadata``'s own place, which no rename can replace, rather than in
    its temporary file's, whose name is the writer's to choose."""
    save, run_dir = tmp_path / "save", tmp_path / "run"
    in_the_way = iteration_dir(save, 4) / ".metadata" / "in-the-way"

    def block_the_second_save() -> None:  # once the first is whole (start-up removes partial folders)
        while not (iteration_dir(save, 2) / MANIFEST_NAME).exists():
            time.sleep(0.01)
        in_the_way.mkdir(parents=True)

    blocker = threading.Thread(target=block_the_second_save, daemon=True)
    blocker.start()
    # Rank 0 slowed 10x from iteration 3: seconds for the folder to be in the way.
    result = train(2, save, 6, run_dir=run_dir, FTMASTER_INJECT_SLOW="0:3:10")
    assert result.returncode == 0, result.stdout[-3000:]
    assert in_the_way.parent.parent.exists() is False  # the failed save's folder is removed
    assert max(iterations(result.stdout)) == 6
    (failed,) = events(run_dir, "save_failed")
    assert failed["iteration"] == 4 and failed["reason"].startswith("writing .metadata: "), failed
    assert [e["iteration"] for e in events(run_dir, "periodic_save")] == [2, 6]
    assert list_iterations(save) == [6, 2] and read_tracker(save) == 6


def test_an_earlier_save_failing_once_training_ended_still_leaves_the_final_save_to_try(tmp_path):
    """With ``--async-save`` the save of iteration 6 fails only at its finalize, which comes
    after the last iteration (7): the final save at 7 is still made, and the run ends with its
    last checkpoint (only a failure at the last iteration itself is not tried again)."""
    save, run_dir = tmp_path / "save", tmp_path / "run"
    in_the_way = iteration_dir(save, 6) / ".metadata" / "in-the-way"

    def block_the_third_save() -> None:
        while not (iteration_dir(save, 4) / MANIFEST_NAME).exists():
            time.sleep(0.01)
        in_the_way.mkdir(parents=True)

    blocker = threading.Thread(target=block_the_third_save, daemon=True)
    blocker.start()
    result = train(2, save, 7, "--async-save", run_dir=run_dir, FTMASTER_INJECT_SLOW="0:4:10")
    assert result.returncode == 0, result.stdout[-3000:]
    (failed,) = events(run_dir, "save_failed")
    assert failed["iteration"] == 6 and failed["reason"].startswith("writing .metadata: "), failed
    assert read_tracker(save) == 7 and list_iterations(save) == [7, 4, 2]


def test_a_run_directory_out_of_room_costs_training_nothing(tmp_path):
    """The heartbeat and events cannot be written (the run directory's filesystem is full):
    training and its checkpoints go on, and each file's failure is said once."""
    with small_tmpfs(tmp_path / "run", "1m") as run_dir:
        with open(run_dir / "filler", "wb", buffering=0) as handle:
            with pytest.raises(OSError):
                while True:
                    handle.write(bytes(4096))
        result = train(2, tmp_path / "save", 6, run_dir=run_dir)
        assert result.returncode == 0, result.stdout[-3000:]
        assert max(iterations(result.stdout)) == 6 and read_tracker(tmp_path / "save") == 6
        for name in ("heartbeat.json", "events.jsonl"):
            assert result.stdout.count(f"error: cannot write {run_dir / name} (ENOSPC") == 1, \
                result.stdout[-3000:]


def test_a_stuck_async_writer_fails_its_own_save_at_its_deadline_and_no_other(tmp_path):
    """Rank 0's writer of the async save at iteration 4 stops before it writes, as on a file
    system that stopped answering. Past ``--async-save-timeout`` that save fails while
    training goes on; the saves behind it complete, and training ends with its last
    checkpoint instead of waiting for the writer.

    The deadline is agreed at every 10th look (one an iteration while a save is in flight),
    after iteration 13 or 14, so the 4 s must have passed by then: rank 0 computes 30x slower
    from iteration 5. At 10x the stuck save had run 7.7 s at that look on a slow host, but
    4.3-5.4 s on one 2x faster (2026-12-06, idle), and under 4 s in a clean clone's first
    pass there, so it failed only at the end; at 30x, 12.2-12.4 s (idle, same host)."""
    save, run_dir = tmp_path / "save", tmp_path / "run"
    result = train(2, save, 16, "--async-save", "--async-save-timeout", "4", run_dir=run_dir,
                   FTMASTER_INJECT_STALL="0:4", FTMASTER_INJECT_SLOW="0:5:30")
    assert result.returncode == 0, result.stdout[-3000:]
    (failed,) = events(run_dir, "save_failed")
    assert failed["iteration"] == 4 and "past the async save deadline of 4 s" in failed["reason"]
    assert [e["iteration"] for e in events(run_dir, "periodic_save")] == \
        [2, *range(6, 17, 2)]
    assert read_tracker(save) == 16 and list_iterations(save) == list(range(16, 5, -2)) + [2]
    log = result.stdout
    assert log.index("error: periodic checkpoint at iteration 4 not saved") < \
        log.index("async periodic save at iteration 16 started"), log[-3000:]


def test_under_ftmaster_the_end_of_training_gives_up_an_idle_writer_before_the_hang_timeout(tmp_path):
    """The end of training waits for every async save, without a heartbeat. With rank 0's
    writer of iteration 4 stopped and the default deadline (600 s), the supervisor would take
    the wait for a hang at its ``--hang-timeout`` (handed over as ``FTMASTER_HANG_TIMEOUT``)
    and relaunch. Once the wait has lasted 3/4 of it with nothing written, save 4 is given up
    instead, and training ends with the save behind it complete."""
    save, run_dir = tmp_path / "save", tmp_path / "run"
    result = train(2, save, 6, "--async-save", run_dir=run_dir, FTMASTER_INJECT_STALL="0:4",
                   FTMASTER_HANG_TIMEOUT="4")
    assert result.returncode == 0, result.stdout[-3000:]
    (failed,) = events(run_dir, "save_failed")
    assert failed["iteration"] == 4 and "75% of ftmaster's --hang-timeout of 4 s" in failed["reason"]
    assert [e["iteration"] for e in events(run_dir, "periodic_save")] == [2, 6]
    assert read_tracker(save) == 6 and list_iterations(save) == [6, 2]
