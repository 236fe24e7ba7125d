"""Fixtures for the kernel tests."""

from kernel_inputs import poison_outputs

__all__ = ["poison_outputs"]
