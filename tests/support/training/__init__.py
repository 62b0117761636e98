"""Helpers of the training tier (tests/real/training): slime's loss path and Megatron on the CPU, and the
reference loss. Each imports megatron-core or slime when imported."""
