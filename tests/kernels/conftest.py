"""Fixtures for the kernel tests."""

from kernel_inputs import forbid_triton, poison_outputs

__all__ = ["forbid_triton", "poison_outputs"]
