"""Warm workers as real processes: what they hold before an assignment, their replacement, the
rank they run, and their death with the process that started them."""

import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from ftmaster.guard import rank_record_path
from ftmaster.recovery.torchrun import StaticWorld
from ftmaster.warm import WarmPool, WarmRanks, rank_env, warm_up_for
from helpers.trainer import REPO, trainer_env, wait_until


@pytest.fixture
def pool_of_two(tmp_path):
    pool = WarmPool(2, tmp_path / "run")
    yield pool
    pool.close()


@pytest.fixture
def sync_pool_of_two(tmp_path):
    """Workers for a command that saves synchronously: no warm-up work."""
    pool = WarmPool(2, tmp_path / "run", warm_up=warm_up_for(["pretrain_gpt.py", "--save", "x"]))
    yield pool
    pool.close()


AUTOGROUPS = Path("/proc/self/autogroup").exists()


def session_nice(pid):
    """The nice value of the process's session ("/autogroup-N nice V")."""
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def ready_workers(pool, count=None):
    count = pool.size if count is None else count
    wait_until(lambda: sum(w.usable for w in pool.workers) >= count, timeout=120,
               what="warm workers ready")
    return [w for w in pool.workers if w.usable]


def test_a_warm_worker_holds_no_process_group_cuda_or_socket_then_runs_its_rank_as_torchrun_would(
        tmp_path, pool_of_two):
    workers = ready_workers(pool_of_two)
    for worker in workers:
        assert worker.ready["cuda_initialized"] is False
        assert worker.ready["process_group"] is False
        process = psutil.Process(worker.process.pid)
        maps = open(f"/proc/{process.pid}/maps").read()
        assert "libtorch" in maps  # the imports are done...
        assert "libcuda" not in maps and "libnccl" not in maps  # ...and no driver is loaded
        assert process.net_connections(kind="inet") == []  # no store, no process group
        assert f"ftmaster.warm {pool_of_two.run_dir}" in " ".join(process.cmdline())
        spawned = [c for c in process.children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(spawned) == 1  # the Manager of --async-save's writer queue, started early
        if AUTOGROUPS:  # the scheduler weighs sessions first: a waiting one at the least
            assert session_nice(process.pid) == 19

    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, torch
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
        # One write per line: both ranks append to one log (print writes the newline apart).
        sys.stdout.write(json.dumps({"argv": sys.argv, "name": __name__, "env": {k: os.environ[k] for k in keys},
                          "threads": torch.get_num_threads(),
                          "session": open("/proc/self/autogroup").read() if os.path.exists(
                              "/proc/self/autogroup") else None,
                          "ps": open("/proc/self/cmdline").read().replace(chr(0), " ")}) + chr(10))
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """))
    rank_dir, log = tmp_path / "ranks", tmp_path / "attempt.log"
    rank_dir.mkdir()
    envs = [rank_env({"PATH": os.environ["PATH"]}, r, 2, rank_dir, "job", None, 29999)
            for r in range(2)]
    ranks = WarmRanks(pool_of_two.take(2), rank_dir, envs, [str(script), "--x", "1"], log)
    assert ranks.wait(60) == 1  # one rank failed, as torchrun would report it
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert sorted(line["env"]["RANK"] for line in lines) == ["0", "1"]
    for line in lines:
        assert line["argv"] == [str(script), "--x", "1"] and line["name"] == "__main__"
        assert line["env"]["WORLD_SIZE"] == "2" and line["env"]["MASTER_PORT"] == "29999"
        assert line["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert line["threads"] == 1  # OMP_NUM_THREADS=1, as torchrun sets it for 2 ranks
        assert line["session"] is None or line["session"].split()[-1] == "0"  # a rank's share
        assert f"-u {script} --x 1" in line["ps"]  # ps shows the rank's command
    records = {r: json.loads(rank_record_path(rank_dir, r).read_text()) for r in range(2)}
    assert {r: rec["exit_code"] for r, rec in records.items()} == {0: 0, 1: 3}
    assert {rec["pid"] for rec in records.values()} == {w.process.pid for w in workers}
    assert all(rec["ended_at"] > 0 for rec in records.values())


def test_a_worker_that_dies_while_waiting_is_replaced_and_never_handed_a_rank(
        tmp_path, sync_pool_of_two):
    first, second = ready_workers(sync_pool_of_two)
    assert all(psutil.Process(w.process.pid).children() == [] for w in (first, second))
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait()
    taken = sync_pool_of_two.take(2, timeout_s=120)
    assert taken is not None and first not in taken and second in taken
    assert all(w.alive for w in taken)
    assert sync_pool_of_two.replaced == 1

    # One that dies after it was picked fails the hand-over: the set is killed, no rank runs.
    os.kill(taken[0].process.pid, signal.SIGKILL)
    taken[0].process.wait()
    rank_dir = tmp_path / "ranks"
    rank_dir.mkdir()
    envs = [rank_env({}, r, 2, rank_dir, "job", None, 29999) for r in range(2)]
    with pytest.raises(OSError):
        WarmRanks(taken, rank_dir, envs, ["x.py"], tmp_path / "log")
    assert not any(w.alive for w in taken) and not list(rank_dir.iterdir())


def test_rank_env_across_nodes_counts_the_ranks_of_the_nodes_before():
    world = StaticWorld(2, 1, "10.0.0.1", 4321, rank_offset=3, world_size=5)
    env = rank_env({"X": "1"}, 1, 2, REPO, "job", world, 0)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE",
                                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "X")} == {
        "RANK": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "5",
        "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "4321", "X": "1"}
    with pytest.raises(ValueError, match="world's size"):
        rank_env({}, 0, 2, REPO, "job", StaticWorld(2, 1, "h", 1), 0)


def test_warm_workers_die_with_the_process_that_started_them(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from ftmaster.warm import WarmPool
            pool = WarmPool(2, {str(tmp_path)!r})
            print(" ".join(str(w.process.pid) for w in pool.workers), flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env=trainer_env(), cwd=REPO)
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    wait_until(lambda: not any(_running(pid) for pid in pids), timeout=10,
               what="warm workers to die with their owner")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
