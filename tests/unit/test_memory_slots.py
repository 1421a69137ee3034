"""The memory tier's slots in one process: records set up once and refilled in place, their
digests taken from the bytes copied, and the rules that keep a complete checkpoint safe."""

import ctypes
import errno
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import xxhash
import xxhash._xxhash

from ftmaster.recovery.checkpoints import advance_tracker, iteration_dir, mark_whole, pin
from ftmaster.recovery.manifest import HELD_MANIFEST_NAME, MANIFEST_NAME, digest_file
from helpers.slots import SHARD, read_back, save
from megatron.training import memory_slots
from megatron.training.memory_slots import MemorySlots, copy_bytes
from megatron.training.records import objects_file

def state(seed: int, rows: int = 4) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(rows, 6, generator=generator),
            "steps": torch.randint(0, 100, (10,), generator=generator),
            "half": torch.randn(3, 5, generator=generator).to(torch.bfloat16)}


@pytest.fixture
def slots(tmp_path):
    slots = MemorySlots(tmp_path)
    yield slots
    slots.close()


def test_the_third_save_refills_the_first_slot_in_place_with_the_new_bytes(tmp_path, slots):
    first_refilled, first = save(slots, tmp_path, 1, state(1))
    second_refilled, _ = save(slots, tmp_path, 2, state(2))
    refilled, third = save(slots, tmp_path, 3, state(3), blob=b"a longer rng state")
    assert (first_refilled, second_refilled, refilled) == (False, False, True)
    assert not iteration_dir(tmp_path, 1).exists()  # renamed: the slot now holds iteration 3
    assert [r.storage_data for r in third if r.index.fqn != "rng"] == \
        [r.storage_data for r in first if r.index.fqn != "rng"]
    folder = iteration_dir(tmp_path, 3)
    for result in third:
        expected = b"a longer rng state" if result.index.fqn == "rng" else state(3)[result.index.fqn]
        got = read_back(folder, result)
        assert got == expected if isinstance(got, bytes) else torch.equal(got, expected)
    assert slots.kept_iterations() == {2, 3}


def test_a_claim_killed_between_its_two_removals_leaves_the_slot_unloadable(
        tmp_path, slots, monkeypatch):
    """The manifest went first: killed then, the old slot kept its ``.metadata``, a
    torch_dist checkpoint without a manifest, which a load takes unverified (as one written
    by another tool)."""
    save(slots, tmp_path, 1, state(1))
    save(slots, tmp_path, 2, state(2))
    (iteration_dir(tmp_path, 1) / memory_slots.DCP_METADATA_FILE).write_bytes(b"metadata")
    removed = []
    unlink = Path.unlink

    def killed_after_one(path, missing_ok=False):
        if removed:
            raise SystemExit("killed")
        removed.append(path.name)
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", killed_after_one)
    with pytest.raises(SystemExit):
        slots.claim(1, iteration_dir(tmp_path, 3))
    assert removed == [memory_slots.DCP_METADATA_FILE]
    assert (iteration_dir(tmp_path, 1) / MANIFEST_NAME).exists()


def test_a_slot_file_whose_mapping_is_refused_leaves_no_file_open(tmp_path, monkeypatch):
    """mmap's ENOMEM (or vm.max_map_count reached) fails the save, as it should; the file
    stayed open, one descriptor more at every such save."""
    path = tmp_path / "shard.distcp"
    path.write_bytes(bytes(4096))

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(memory_slots.mmap, "mmap", refused)
    open_before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(OSError, match="Cannot allocate memory"):
            memory_slots._SlotFile(path, {})
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_the_file_system_of_a_folder_is_its_deepest_mount_the_last_mounted(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      "tmpfs /dev/shm tmpfs rw 0 0\n"
                      "srv:/ckpt /mnt/my\\040ckpt nfs4 rw 0 0\n"
                      "pool /data zfs rw 0 0\n"
                      "/dev/vdb /data btrfs rw 0 0\n"
                      "broken\n")
    assert [memory_slots.file_system_type(Path(path), mounts) for path in (
        "/dev/shm/ckpt/memory", "/mnt/my ckpt/run/non_persistent", "/data/x", "/dev/shmx",
        "/")] == ["tmpfs", "nfs4", "btrfs", "ext4", "ext4"]
    assert memory_slots.file_system_type(tmp_path, tmp_path / "none") is None


def test_a_tier_on_a_file_system_that_may_not_rewrite_in_place_is_never_refilled(
        tmp_path, monkeypatch):
    """On btrfs (copy on write), NFS or FUSE a store into the mapping that finds no room or
    meets an I/O error is SIGBUS: the rank died where a write(2) fails only the save."""
    monkeypatch.setattr(memory_slots, "file_system_type", lambda path: "btrfs")
    mapped = []
    monkeypatch.setattr(memory_slots.mmap, "mmap", lambda *args, **kwargs: mapped.append(args))
    slots = MemorySlots(tmp_path)
    try:
        refilled = [save(slots, tmp_path, iteration, state(iteration))[0]
                    for iteration in (1, 2, 3)]
    finally:
        slots.close()
    assert refilled == [False, False, False] and mapped == []
    assert iteration_dir(tmp_path, 1).exists()  # written anew, not renamed to iteration 3
    assert slots.digests[SHARD].digest == digest_file(iteration_dir(tmp_path, 3) / SHARD)


@pytest.fixture(params=["in C", "in Python"])
def either_loop(request, monkeypatch):
    """The refill's loop in C (``stream_copy.c``) and its Python twin, where C's is missing."""
    if request.param == "in Python":
        monkeypatch.setattr(memory_slots, "native_refill", None)
    elif memory_slots.native_refill is None:
        pytest.skip("stream_copy.c not built")


def test_a_refill_leaves_the_digests_of_what_the_file_now_holds(tmp_path, slots, either_loop):
    for iteration in (1, 2, 3):
        save(slots, tmp_path, iteration, state(iteration))
    folder = iteration_dir(tmp_path, 3)
    assert sorted(slots.digests) == sorted(path.name for path in folder.iterdir()
                                           if path.name != MANIFEST_NAME)
    reported = slots.digests[SHARD]
    assert reported.digest == digest_file(folder / SHARD)
    data = (folder / SHARD).read_bytes()
    assert sum(item.bytes for item in reported.items.values()) == len(data)  # items tile the file
    for offset, item in reported.items.items():
        assert xxhash.xxh3_64(data[offset:offset + item.bytes]).hexdigest() == item.digest
    assert slots.digests[objects_file(0)].digest == digest_file(folder / objects_file(0))


def test_a_refill_copies_a_strided_tensor_in_row_major_order(tmp_path, slots, either_loop):
    """The refill copies raw bytes: a transposed view must land as its values, not its storage."""
    def strided(seed: int) -> dict:
        return {"weight_t": torch.randn(6, 4, generator=torch.Generator().manual_seed(seed)).t()}
    for iteration in (1, 2, 3):
        refilled, written = save(slots, tmp_path, iteration, strided(iteration))
    assert refilled and not strided(3)["weight_t"].is_contiguous()
    assert torch.equal(read_back(iteration_dir(tmp_path, 3), written[0]), strided(3)["weight_t"])


def test_a_refill_copies_a_strided_byte_tensor_as_its_values(tmp_path, slots, either_loop):
    """A one-byte dtype's strided view stays a view through ``reshape``: its storage's bytes
    were copied (and their digest blessed them), not its values."""
    def every_other(seed: int) -> dict:
        return {"mask": (torch.arange(32, dtype=torch.uint8) + seed)[::2]}
    for iteration in (1, 2, 3):
        refilled, written = save(slots, tmp_path, iteration, every_other(iteration))
    assert refilled
    assert torch.equal(read_back(iteration_dir(tmp_path, 3), written[0]), every_other(3)["mask"])


def test_tensors_of_another_shape_set_the_file_up_again(tmp_path, slots):
    for iteration in (1, 2):
        save(slots, tmp_path, iteration, state(iteration))
    refilled, written = save(slots, tmp_path, 3, state(3, rows=7))
    assert refilled  # the folder is the slot's; its file is written afresh for the new shapes
    weight = next(r for r in written if r.index.fqn == "weight")
    assert torch.equal(read_back(iteration_dir(tmp_path, 3), weight), state(3, rows=7)["weight"])


def test_a_new_structure_drops_both_slots(tmp_path, slots):
    for iteration in (1, 2):
        save(slots, tmp_path, iteration, state(iteration))
    refilled, _ = save(slots, tmp_path, 3, state(3), kept=False)
    assert not refilled and iteration_dir(tmp_path, 1).exists()  # left for the pruning
    assert slots.kept_iterations() == {3}


def test_a_failed_save_lets_go_of_both_slots(tmp_path, slots):
    """A save that failed (a full tier) leaves the other slot's checkpoint to the pruning: kept
    mapped, its pages stayed held however superseded it was, and every later save was short."""
    for iteration in (1, 2):
        save(slots, tmp_path, iteration, state(iteration))
    slots.use(slots.claim(slots.begin(True), iteration_dir(tmp_path, 3)))
    slots.ended(3, complete=False)
    assert slots.kept_iterations() == set()
    refilled, _ = save(slots, tmp_path, 4, state(4))
    assert not refilled and (iteration_dir(tmp_path, 2) / MANIFEST_NAME).exists()


def test_a_pinned_tracked_or_whole_slot_is_never_refilled(tmp_path, slots):
    for iteration in (1, 2):
        save(slots, tmp_path, iteration, state(iteration))
    assert pin(tmp_path, 1)  # a persist copy reads iteration 1
    refilled, _ = save(slots, tmp_path, 3, state(3))
    assert not refilled and (iteration_dir(tmp_path, 1) / MANIFEST_NAME).exists()
    advance_tracker(tmp_path, 2)  # the tracker names the slot's checkpoint
    refilled, _ = save(slots, tmp_path, 4, state(4))
    assert not refilled and (iteration_dir(tmp_path, 2) / MANIFEST_NAME).exists()
    assert mark_whole(tmp_path, 3)  # across nodes: the newest copy whole here
    refilled, _ = save(slots, tmp_path, 5, state(5))
    assert not refilled and (iteration_dir(tmp_path, 3) / MANIFEST_NAME).exists()


def test_a_refilled_slot_loses_its_manifest_and_metadata_before_the_copy(tmp_path, slots):
    for iteration in (1, 2):
        save(slots, tmp_path, iteration, state(iteration))
    (iteration_dir(tmp_path, 1) / ".metadata").write_bytes(b"iteration 1's")
    assert slots.claim(slots.begin(True), iteration_dir(tmp_path, 3))
    left = {path.name for path in iteration_dir(tmp_path, 3).iterdir()}
    assert MANIFEST_NAME not in left and ".metadata" not in left and SHARD in left


def test_a_node_local_slot_drops_the_peer_copies_it_will_not_rewrite(tmp_path):
    """A node's folder also holds copies of other nodes' shards and of rank 0's files: once
    renamed to a new iteration they would sit there at their size with the old bytes, and
    count as held. The slot keeps only what its own ranks (here 0 and 1) rewrite."""
    slots = MemorySlots(tmp_path, node_writers={0, 1})
    try:
        for iteration in (1, 2):
            save(slots, tmp_path, iteration, state(iteration))
        copies = ["__2_0.distcp", "__3_1.distcp", "common.pt", HELD_MANIFEST_NAME]
        for name in copies + ["__1_0.distcp"]:
            (iteration_dir(tmp_path, 1) / name).write_bytes(b"iteration 1's")
        assert slots.claim(slots.begin(True), iteration_dir(tmp_path, 3))
    finally:
        slots.close()
    left = {path.name for path in iteration_dir(tmp_path, 3).iterdir()}
    assert SHARD in left and "__1_0.distcp" in left and not left & set(copies)


def _can_build_extensions() -> bool:
    """A C compiler and Python's headers (Debian's python3-dev), as setup.sh checks."""
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    return shutil.which("cc") is not None and os.path.isfile(headers)


@pytest.mark.skipif(not _can_build_extensions(),
                    reason="no C compiler or no Python headers: the refill copies with memmove")
def test_the_streaming_copy_was_built_where_a_compiler_is():
    assert copy_bytes is not ctypes.memmove
    assert memory_slots.native_refill is not None  # and python-xxhash exports XXH3's calls


def _xxh3_digest(calls, data: bytes, pieces: int) -> int:
    state = calls.create_state()
    try:
        calls.reset(state)
        step = max(1, len(data) // pieces)
        for start in range(0, len(data), step):
            calls.update(state, data[start:start + step], len(data[start:start + step]))
        return calls.digest(state)
    finally:
        calls.free_state(state)


@pytest.mark.parametrize("length", [0, 17, 240, 241, 1024, 65_536 + 5, 3_000_001])
def test_the_refill_hashes_give_python_xxhash_digests(length):
    """The calls the refill hashes with (python-xxhash's update dispatched to AVX2, here) give
    the manifest readers' digests: short inputs, XXH3's long path, uneven updates."""
    if memory_slots.native_refill is None:
        pytest.skip("the refill loops in Python, with python-xxhash itself")
    data = os.urandom(length)
    for pieces in (1, 3):
        assert _xxh3_digest(memory_slots.native_refill.hashes, data, pieces) == xxhash.xxh3_64_intdigest(data)


def test_a_hash_library_whose_digests_differ_is_not_used(monkeypatch):
    """Calls that would not give the readers' digests (an update that is not XXH3's) are not
    used; nor are a missing call or library."""
    assert memory_slots._xxh3_of(xxhash._xxhash.__file__, "XXH3_64bits_update") is not None
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: 42)
    assert memory_slots._xxh3_of(xxhash._xxhash.__file__, "XXH3_64bits_update") is None
    assert memory_slots._xxh3_of(xxhash._xxhash.__file__, "XXH3_no_such_call") is None
    assert memory_slots._xxh3_of("/no/such/libxxhash.so", "XXH3_64bits_update") is None


@pytest.mark.parametrize("length", [0, 1, 15, 16, 63, 64, 65, 4096 + 17, 1_000_003])
@pytest.mark.parametrize("misaligned", [0, 1, 9])
def test_the_refill_copy_copies_every_byte_whatever_the_alignment(length, misaligned):
    """The streaming loop's aligned head, 64-byte blocks and tail, and nothing past the end."""
    source = torch.randint(0, 256, (length + 32,), dtype=torch.uint8)
    target = torch.zeros(length + 64, dtype=torch.uint8)
    copy_bytes(target.data_ptr() + misaligned, source.data_ptr() + 3, length)
    assert torch.equal(target[misaligned:misaligned + length], source[3:3 + length])
    assert not target[:misaligned].any() and not target[misaligned + length:].any()


class _LandedEvent:
    """A CUDA event on a CPU build (whose ``torch.cuda.Event`` cannot be made): the copy it
    follows, host to host, has already landed."""

    waited = 0

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        _LandedEvent.waited += 1


def test_the_pinned_refill_lays_each_tensors_bytes_at_its_record_whatever_the_offset(tmp_path, monkeypatch):
    """The refill's CUDA path (a pinned mapping, ``copy_`` into each record, one event per
    tensor), run with CPU tensors and the driver calls stood in for: torch_dist's records sit
    at any byte offset, so a record's bytes cannot be viewed as its dtype (a float32 record
    at offset 2281 raised "storage_offset() must be divisible by 4")."""
    from torch.cuda import _pin_memory_utils

    pinned = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _LandedEvent)
    monkeypatch.setattr(_pin_memory_utils, "pin_memory", lambda ptr, size: pinned.update({ptr: size}))
    monkeypatch.setattr(_pin_memory_utils, "unpin_memory", lambda ptr: pinned.pop(ptr))

    def odd_state(seed: int) -> dict:  # odd lengths: every record after the first is unaligned
        generator = torch.Generator().manual_seed(seed)
        return {"a_half": torch.randn(3, generator=generator).to(torch.bfloat16),
                "b_weight": torch.randn(5, 7, generator=generator),
                "c_bytes": torch.randint(-100, 100, (3,), generator=generator, dtype=torch.int8),
                "d_double": torch.randn(17, generator=generator).double(),
                "e_strided": torch.randn(4, 6, generator=generator).t(),
                "f_flags": torch.rand(5, generator=generator) > 0.5}

    slots = MemorySlots(tmp_path)
    try:
        for iteration in (1, 2, 3):
            refilled, written = save(slots, tmp_path, iteration, odd_state(iteration))
        assert refilled and pinned  # the slot's mapping was registered
        _LandedEvent.waited = 0
        refilled, written = save(slots, tmp_path, 4, odd_state(4))
        assert refilled and _LandedEvent.waited == len(odd_state(4))
        folder = iteration_dir(tmp_path, 4)
        for result in written:
            if result.index.fqn != "rng":
                assert torch.equal(read_back(folder, result), odd_state(4)[result.index.fqn]), \
                    result.index.fqn
        assert slots.digests[SHARD].digest == digest_file(folder / SHARD)
    finally:
        slots.close()
    assert not pinned  # unregistered when the slot closed


def test_a_slot_the_driver_will_not_pin_is_refilled_through_the_host(tmp_path, monkeypatch, capsys):
    """``cudaHostRegister`` may refuse a slot's mapping. The save failed at every set-up, and
    the refused call's error, which torch's binding leaves pending on the thread, would have
    been raised by the next kernel launch, in whatever op came next. Now the slot is refilled
    through the host (correct, slower), the pending error is taken off, and the rank says so."""
    from torch.cuda import _pin_memory_utils

    from megatron.training import memory_slots

    def refuse(ptr: int, size: int) -> None:
        raise RuntimeError("Registering memory failed with cudaError: 2.")

    cleared = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_pin_memory_utils, "pin_memory", refuse)
    monkeypatch.setattr(_pin_memory_utils, "unpin_memory",
                        lambda ptr: pytest.fail("a mapping never pinned was unpinned"))
    monkeypatch.setattr(memory_slots, "_clear_pending_cuda_error", lambda: cleared.append(1),
                        raising=False)
    slots = MemorySlots(tmp_path)
    try:
        for iteration in (1, 2, 3):
            refilled, written = save(slots, tmp_path, iteration, state(iteration))
        assert refilled and len(cleared) == 2  # both slots' set-ups were refused
        folder = iteration_dir(tmp_path, 3)
        for result in written:
            if result.index.fqn != "rng":
                assert torch.equal(read_back(folder, result), state(3)[result.index.fqn])
        assert slots.digests[SHARD].digest == digest_file(folder / SHARD)
    finally:
        slots.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "pinned" in line]
    assert len(warnings) == 1 and "cudaError: 2" in warnings[0], warnings
