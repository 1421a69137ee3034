"""Health evidence and the unschedulable rule: pure functions, table-tested."""

import pytest

from ftmaster.monitor.health import (DEFAULT_UNSCHEDULABLE_XIDS, GpuEvidence, HealthConfig, observe_conditions,
                                     observe_sample, unschedulable_reason)
from ftmaster.monitor.sample import GpuSample

T0 = 1_750_000_000.0
CONFIG = HealthConfig()


def sample(**values):
    base = dict(errors=0, ecc_dbe=0, xid=None, retired_pages_pending=0, recovery_action=0)
    return GpuSample(timestamp=T0, gpu_id=0, **{**base, **values})


def evidence_from(*samples, conditions=()):
    evidence = GpuEvidence()
    for s in samples:
        evidence = observe_sample(evidence, s)
    return observe_conditions(evidence, conditions)


@pytest.mark.parametrize("code", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120])
def test_the_issues_critical_xids_are_unschedulable_by_default(code):
    assert code in DEFAULT_UNSCHEDULABLE_XIDS
    assert unschedulable_reason(evidence_from(sample(xid=code)), CONFIG) == f"xid_{code}"


@pytest.mark.parametrize("samples, conditions, reason", [
    ([sample()], (), None),
    ([sample(xid=13)], (), None),  # an application XID blames the program
    ([sample(xid=31), sample(xid=None)], (), None),
    ([sample(xid=94), sample(xid=None)], (), "xid_94"),  # an XID is an event: it stays
    ([sample(xid=94), sample(xid=79)], (), "xid_79"),  # the most severe
    ([sample(ecc_dbe=0), sample(ecc_dbe=1)], (), "ecc_dbe"),
    ([sample(errors=3), sample(errors=None), sample(errors=4)], (), "ecc_dbe"),  # across a failed read
    ([sample(ecc_dbe=7)], (), None),  # old errors at start: no new error seen
    ([sample(recovery_action=1)], (), "recovery_action_1"),
    ([sample(recovery_action=4), sample(recovery_action=None)], (), "recovery_action_4"),  # unknown != cleared
    ([sample(recovery_action=2), sample(recovery_action=0)], (), None),  # the driver cleared it
    ([sample(retired_pages_pending=1)], (), None),  # pending: a reset applies it; alerts, not retires
    ([sample()], ("row_remap_failure",), "row_remap_failure"),
    ([sample()], ("reset_required",), "reset_required"),
    ([sample()], ("wedged",), "wedged"),
    ([sample()], ("gpu_is_lost",), "gpu_is_lost"),
    ([sample(xid=79, ecc_dbe=0), sample(ecc_dbe=1)], ("reset_required",), "reset_required"),
    ([sample(xid=48, recovery_action=1)], (), "xid_48"),
    ([sample(temperature=None, errors=None, ecc_dbe=None, recovery_action=None, retired_pages_pending=None)],
     (), None),  # nothing read is no evidence either way
])
def test_unschedulable_reason(samples, conditions, reason):
    assert unschedulable_reason(evidence_from(*samples, conditions=conditions), CONFIG) == reason


def test_the_xid_set_is_configurable():
    high_sbe_rate = evidence_from(sample(xid=92))
    assert unschedulable_reason(high_sbe_rate, CONFIG) == "xid_92"
    lenient = HealthConfig(unschedulable_xids=DEFAULT_UNSCHEDULABLE_XIDS - {92})
    assert unschedulable_reason(high_sbe_rate, lenient) is None
    assert unschedulable_reason(evidence_from(sample(xid=13)), HealthConfig(unschedulable_xids={13})) == "xid_13"


@pytest.mark.parametrize("codes", [{0}, {-1}, {"79"}])
def test_bad_xid_sets_are_refused(codes):
    with pytest.raises(ValueError, match="XID numbers >= 1"):
        HealthConfig(unschedulable_xids=codes)
