"""Triton kernels for the paged KV cache, each beside its plain-torch reference."""

from nanoserve.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
)
from nanoserve.kernels.shared_prefix import SharedPrefixPlan, plan_shared_prefix
from nanoserve.kernels.slot_scatter import slot_scatter, slot_scatter_ref

__all__ = [
    "SharedPrefixPlan",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_extend_attention",
    "paged_extend_attention_ref",
    "plan_shared_prefix",
    "slot_scatter",
    "slot_scatter_ref",
]
