"""ftmaster: proactive fault tolerance for Megatron training."""

__version__ = "0.1.0"
