"""Retirements carried over to a supervisor started again on a run directory: only within the
boot that recorded them."""

import pytest

from ftmaster.retirements import boot_id, carried_over

BOOT = "7f1c0c52-6a0e-4c8b-9b5e-0d6f1f2a9c11"


def plan(boot, *retired):
    return {"event": "plan", "time": 1.0, "boot": boot,
            "gpus_retired": [{"gpu": gpu, "reason": why} for gpu, why in retired]}


@pytest.mark.parametrize("events, boot, expected", [
    ([plan(BOOT, (1, "drained: a straggler"))], BOOT, {1: "drained: a straggler"}),
    # the last plan's list is the whole of it: GPU 2 retired before is in it again
    ([plan(BOOT, (2, "lost")), plan(BOOT, (1, "hang"), (2, "lost"))], BOOT, {1: "hang", 2: "lost"}),
    ([plan(BOOT, (1, "lost"))], "another-boot", {}),  # rebooted since: the GPUs are reset
    ([plan(None, (1, "lost"))], BOOT, {}),  # an older ftmaster's event: no boot to compare
    ([plan(BOOT, (1, "lost"))], None, {}),  # this kernel gives no boot id
    ([{"event": "launch", "time": 0.0}], BOOT, {}),  # no plan: nothing was retired
    ([plan(BOOT, (7, "lost"))], BOOT, {}),  # not a GPU of this supervisor's
    ([{**plan(BOOT), "gpus_retired": "garbled"}], BOOT, {}),
    ([{**plan(BOOT), "gpus_retired": [3, {"reason": "no gpu"}, {"gpu": 1}]}], BOOT, {1: "retired"}),
])
def test_only_the_last_plans_retirements_of_the_same_boot_carry_over(events, boot, expected):
    assert carried_over(events, boot, gpus=[0, 1, 2, 3]) == expected


def test_the_boot_id_is_the_kernels_or_unknown(tmp_path):
    path = tmp_path / "boot_id"
    path.write_text(f"{BOOT}\n")
    assert boot_id(path) == BOOT
    assert boot_id(tmp_path / "missing") is None
    path.write_text("")
    assert boot_id(path) is None


def failure(time, *unfit):
    return {"event": "failure", "time": time,
            "unfit_gpus": [{"gpu": gpu, "reason": why} for gpu, why in unfit]}


@pytest.mark.parametrize("events, expected", [
    # the node exited (75: the store's host was lost) before the round that would have planned
    # without GPU 1: the requeued job trained on it again
    ([plan(BOOT), failure(2.0, (1, "device_lost"))], {1: "device_lost"}),
    ([plan(BOOT, (2, "hang")), failure(2.0, (1, "xid_79"))], {1: "xid_79", 2: "hang"}),
    ([failure(0.5, (1, "device_lost")), plan(BOOT)], {}),  # planned after it: the plan says
    ([plan(BOOT), {**failure(2.0), "unfit_gpus": "garbled"}], {}),
    ([plan("another-boot"), failure(2.0, (1, "device_lost"))], {}),
])
def test_a_failures_unfit_gpus_not_yet_planned_without_carry_over(events, expected):
    assert carried_over(events, BOOT, gpus=[0, 1, 2, 3]) == expected


def launch(boot):
    return {"event": "launch", "time": 1.0, **({} if boot is None else {"boot": boot})}


def retired(time, *gpus):
    return {"event": "retired", "time": time,
            "gpus_retired": [{"gpu": gpu, "reason": why} for gpu, why in gpus]}


@pytest.mark.parametrize("events, expected", [
    # drained, then the supervisor gave up (its restart budget spent) before a plan said so:
    # the requeued job planned on the drained GPU again
    ([plan(BOOT), retired(2.0, (1, "drained: a straggler"))], {1: "drained: a straggler"}),
    # a rank outlived its kill: its GPU is still held, by a process stuck in the kernel
    ([launch(BOOT), failure(2.0), retired(2.5, (3, "process_stuck"))], {3: "process_stuck"}),
    ([plan(BOOT, (2, "hang")), retired(2.0, (1, "process_stuck")), failure(3.0, (0, "lost"))],
     {0: "lost", 1: "process_stuck", 2: "hang"}),
    ([retired(0.5, (1, "process_stuck")), plan(BOOT)], {}),  # planned after it: the plan says
    ([plan("another-boot"), retired(2.0, (1, "process_stuck"))], {}),  # rebooted since
])
def test_gpus_retired_before_a_plan_said_so_carry_over(events, expected):
    assert carried_over(events, BOOT, gpus=[0, 1, 2, 3]) == expected


@pytest.mark.parametrize("events, expected", [
    # killed while waiting for GPUs after its first attempt, launched without a plan: the
    # next supervisor trained on GPU 2 again
    ([launch(BOOT), failure(2.0, (2, "xid_74"))], {2: "xid_74"}),
    ([launch("another-boot"), failure(2.0, (2, "xid_74"))], {}),  # rebooted since
    ([plan(BOOT, (1, "hang")), launch("another-boot"), failure(2.0, (2, "xid_74"))], {}),
    # an older ftmaster's launch records no boot: its plan's still counts
    ([plan(BOOT, (1, "hang")), launch(None), failure(2.0, (2, "xid_74"))],
     {1: "hang", 2: "xid_74"}),
    ([launch(BOOT), failure(1.0, (1, "lost")), plan(BOOT, (1, "lost")), launch(BOOT),
      failure(2.0, (2, "hang"))], {1: "lost", 2: "hang"}),
])
def test_the_failures_of_a_first_attempt_launched_without_a_plan_carry_over(events, expected):
    assert carried_over(events, BOOT, gpus=[0, 1, 2, 3]) == expected


def test_a_gpu_is_carried_over_by_uuid_where_nvml_gave_one():
    """A supervisor started again in a container given other GPUs: NVML numbers them from 0,
    and 'GPU 2 retired' retired whichever healthy GPU now had index 2, while the bad one,
    back under another index, was planned on again."""
    retired = plan(BOOT, (2, "xid_79"))
    retired["gpus_retired"][0]["uuid"] = "GPU-bad"
    here = {0: "GPU-a", 1: "GPU-bad", 2: "GPU-c", 3: "GPU-d"}
    assert carried_over([retired], BOOT, gpus=[0, 1, 2, 3], uuids=here) == {1: "xid_79"}
    elsewhere = {0: "GPU-a", 1: "GPU-b", 2: "GPU-c", 3: "GPU-d"}
    assert carried_over([retired], BOOT, gpus=[0, 1, 2, 3], uuids=elsewhere) == {}
    assert carried_over([retired], BOOT, gpus=[0, 1, 2, 3]) == {2: "xid_79"}  # no NVML: indices
