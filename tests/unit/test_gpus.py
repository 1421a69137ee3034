"""Which GPUs a job gets and what CUDA is told: indices or UUIDs, MIG, unusable GPUs,
virtual slots, hidden GPUs."""

import pytest

from ftmaster.gpus import JobGpus, choose_job_gpus, visible_entries
from ftmaster.monitor.backends.nvml import GpuIdentity

NODE = [GpuIdentity(i, f"GPU-{i}aaa-{i}", False) for i in range(4)]


@pytest.mark.parametrize("value, entries", [(None, None), ("", ()), ("0,2, 3", ("0", "2", "3")),
                                            ("GPU-1a,GPU-2b", ("GPU-1a", "GPU-2b"))])
def test_visible_entries(value, entries):
    assert visible_entries(value) == entries


@pytest.mark.parametrize("nproc, entries, identities, ids", [
    (4, None, None, (0, 1, 2, 3)),  # CPU: virtual slots
    (None, None, NODE, (0, 1, 2, 3)),  # every GPU NVML sees
    (2, None, NODE, (0, 1)),
    (None, ("3", "1"), NODE, (3, 1)),  # CUDA_VISIBLE_DEVICES order
    (None, ("GPU-2aaa-2", "GPU-0"), NODE, (2, 0)),  # UUIDs, a unique prefix is enough
    (2, ("4", "5", "6"), None, (4, 5)),  # indices without NVML
    (3, (), None, (0, 1, 2)),  # hidden: virtual slots, never real GPUs
])
def test_choose_job_gpus(nproc, entries, identities, ids):
    assert choose_job_gpus(nproc, entries, identities).ids == ids


def test_cuda_is_told_uuids_so_a_missing_gpu_cannot_shift_the_others():
    job = choose_job_gpus(None, None, NODE)
    env = job.cuda_env((0, 2, 3))
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-0aaa-0,GPU-2aaa-2,GPU-3aaa-3",
                   "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert JobGpus((0, 1)).cuda_env((1,)) == {"CUDA_VISIBLE_DEVICES": "1",
                                              "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_hidden_gpus_stay_hidden_in_every_attempt():
    job = choose_job_gpus(2, (), None)
    assert job.hidden and job.cuda_env((0, 1)) == {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("value, entries", [("-1", ()), ("0,2,-1,1", ("0", "2")), ("1, -3", ("1",))])
def test_cuda_sees_no_gpu_from_an_invalid_index_on(value, entries):
    """CUDA stops at the first invalid index: ``-1`` is the usual way to hide every GPU. It
    was taken for a UUID, and the launch refused ("names a GPU by UUID")."""
    assert visible_entries(value) == entries
    assert choose_job_gpus(2, visible_entries("-1"), None).cuda_env((0, 1)) == {"CUDA_VISIBLE_DEVICES": ""}

def test_unusable_gpus_are_left_out_with_their_reason():
    node = [*NODE[:2], GpuIdentity(2, "GPU-2", False, "reset_required"), NODE[3]]
    job = choose_job_gpus(None, None, node)
    assert job.ids == (0, 1, 3) and job.left_out == {2: "reset_required"}


def test_a_gpu_named_by_uuid_whose_uuid_nvml_cannot_read_is_left_out():
    """A lost or wedged GPU gives NVML no UUID: a relaunch after it failed was refused ("no GPU
    has UUID ..."), where the same GPU named by index is left out."""
    node = [NODE[0], GpuIdentity(1, None, None, "wedged"), *NODE[2:]]
    job = choose_job_gpus(None, ("GPU-0aaa", "GPU-1aaa", "GPU-2aaa"), node)
    assert job.ids == (0, 2) and job.left_out == {1: "wedged"}
    two_unread = [NODE[0], GpuIdentity(1, None, None, "wedged"), GpuIdentity(2, None, None, "lost"),
                  NODE[3]]
    with pytest.raises(ValueError, match="no usable GPU has UUID GPU-1aaa, and NVML could not read "
                       "the UUIDs of GPU 1 \\(wedged\\), GPU 2 \\(lost\\): leave the unusable"):
        choose_job_gpus(None, ("GPU-0aaa", "GPU-1aaa"), two_unread)


@pytest.mark.parametrize("nproc, entries, identities, message", [
    (None, None, None, "no GPU is visible: give --nproc-per-node N"),
    (None, (), NODE, "no GPU is visible"),
    (5, None, NODE, "--nproc-per-node 5 needs 5 GPUs, but only 4 are usable (0,1,2,3)"),
    (4, None, [*NODE[:3], GpuIdentity(3, "GPU-3", False, "wedged")],
     "only 3 are usable (0,1,2): GPU 3 wedged"),
    (None, None, [NODE[0], GpuIdentity(1, "GPU-1", True)],
     "GPU 1 is in MIG mode: ftmaster plans whole GPUs; turn MIG off (nvidia-smi -i 1 -mig 0)"),
    (None, ("MIG-5c1e",), NODE, "MIG-5c1e is a MIG instance"),
    (None, ("GPU-ff",), NODE, "no GPU has UUID GPU-ff"),
    (None, ("7",), NODE, "CUDA_VISIBLE_DEVICES names GPU 7, which NVML does not see (it sees 4)"),
    (2, ("GPU-1a",), None, "names a GPU by UUID; mapping it needs NVML"),
    (None, ("1", "GPU-1aaa"), NODE, "CUDA_VISIBLE_DEVICES names GPU 1 twice"),
    (2, ("0", "0"), None, "CUDA_VISIBLE_DEVICES names GPU 0 twice"),
])
def test_choose_job_gpus_refuses_in_one_line(nproc, entries, identities, message):
    with pytest.raises(ValueError) as refused:
        choose_job_gpus(nproc, entries, identities)
    assert message in str(refused.value) and "\n" not in str(refused.value)
