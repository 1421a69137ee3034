"""Megatron-LM-compatible trainer built on the megatron-core package."""

import warnings

# megatron-core warns at import for every optional fused kernel it falls back from, and torch's
# checkpoint planner for APIs that megatron-core still calls. Neither is actionable for a user.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "Please use DTensor instead", "`load_state_dict` is deprecated",
                 "Transformer Engine is not installed"):
    warnings.filterwarnings("ignore", message=_message)
