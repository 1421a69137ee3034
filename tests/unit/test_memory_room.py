"""The memory tier's room: on tmpfs, what this process's memory cgroup has left too."""

import shutil

import pytest

from ftmaster.recovery.memory_room import cgroup_memory_left, on_tmpfs, room


def cgroup(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_v2_takes_the_least_room_of_the_cgroup_and_its_ancestors(tmp_path):
    """A pod's limit sits on an ancestor; its page cache that tmpfs did not write is room."""
    root = tmp_path / "sys"
    cgroup(root / "kubepods" / "pod1", memory_max="8000", memory_current="5000",
           memory_stat="anon 1000\nfile 3000\nshmem 2500\n")  # 500 reclaimable: 3500 left
    cgroup(root / "kubepods", memory_max="max", memory_current="9000")
    cgroup(root, memory_current="12000")  # the root has no limit file
    (tmp_path / "cgroup").write_text("0::/kubepods/pod1\n")
    assert cgroup_memory_left(tmp_path / "cgroup", root) == 3500
    cgroup(root / "kubepods", memory_max="10000")  # 1000 left above the pod
    assert cgroup_memory_left(tmp_path / "cgroup", root) == 1000


def test_v1_reads_the_memory_hierarchy_and_skips_what_a_namespace_hides(tmp_path):
    root = tmp_path / "sys"
    # a cgroup namespace: the process's own cgroup is the mount's root, its path's parts absent
    cgroup(root / "memory", memory_limit_in_bytes="4000", memory_usage_in_bytes="3000",
           memory_stat="cache 900\nshmem 100\ntotal_cache 1000\ntotal_shmem 400\n")
    (tmp_path / "cgroup").write_text("9:name=systemd:/\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory_left(tmp_path / "cgroup", root) == 1000 + 600


@pytest.mark.parametrize("limit", ["9223372036854771712", "garbage"])
def test_no_limit_or_an_unreadable_one_is_none(tmp_path, limit):
    cgroup(tmp_path / "sys" / "memory", memory_limit_in_bytes=limit, memory_usage_in_bytes="10")
    (tmp_path / "cgroup").write_text("4:memory:/\n")
    assert cgroup_memory_left(tmp_path / "cgroup", tmp_path / "sys") is None
    assert cgroup_memory_left(tmp_path / "missing", tmp_path / "sys") is None


def test_the_room_is_the_cgroups_on_tmpfs_only_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 10**10))
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"overlay / overlay rw 0 0\ntmpfs {shm} tmpfs rw 0 0\n")
    cgroup(tmp_path / "sys", memory_max="3000000000", memory_current="1000000000")
    (tmp_path / "cgroup").write_text("0::/\n")
    assert on_tmpfs(shm / "ftmaster-run", mounts) and not on_tmpfs(disk, mounts)
    limited = room(shm, mounts, tmp_path / "cgroup", tmp_path / "sys")
    assert limited.free == 2_000_000_000
    assert limited.note == (" (its file system has 10.00 GB, but this process's memory cgroup, "
                            "which tmpfs pages are charged to, has only that left)")
    assert room(disk, mounts, tmp_path / "cgroup", tmp_path / "sys") == (10**10, "")
