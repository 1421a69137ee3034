"""Megatron-LM-compatible trainer built on the megatron-core package."""
