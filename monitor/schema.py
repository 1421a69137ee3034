"""The ``gpu_metrics.csv`` columns: the contract shared by the monitor, replay and analysis."""

# The paper's Table I, in order.
TABLE_I_COLUMNS = (
    "timestamp",  # ISO 8601, UTC
    "gpu_id",
    "gpu_name",
    "driver_version",
    "temperature",  # degrees C
    "power_draw",  # W
    "gpu_utilization",  # %
    "memory_utilization",  # %
    "memory_used",  # MiB
    "memory_total",  # MiB
    "errors",  # cumulative uncorrectable errors
)

# Written where the backend has them; a missing one means "not available", never "healthy".
OPTIONAL_COLUMNS = (
    "ecc_sbe",  # cumulative volatile single-bit
    "ecc_dbe",  # cumulative volatile double-bit
    "xid",  # XID code seen in this interval, else empty
    "throttle_reasons",  # NVML clocks-event bitmask
    "power_limit",  # W
    "sm_clock",  # MHz
    "pcie_replay",
    "retired_pages_pending",
    "recovery_action",
)

RISK_COLUMN = "failure_risk"

CSV_COLUMNS = TABLE_I_COLUMNS + OPTIONAL_COLUMNS + (RISK_COLUMN,)
