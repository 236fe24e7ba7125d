"""A step's rotary cos and sin in one launch.

A model of the Llama and Gemma families computes the cos and sin its layers share once a
step, in its rotary embedding module (``model.model.rotary_emb``): eagerly about ten small
launches (the float positions, the product with the frequencies, the concatenation, cos,
sin, the scaling, the casts). Inside ``FusedDecode.active()`` a module of the family's
``rotary_embedding_classes`` whose class runs transformers' forward computes them with
``rotary_cos_sin`` instead: the same float32 product, CUDA's cosf and sinf, the same scaling
and rounding, so the tables are bit-equal to eager's. Anything else runs the module's own
forward: a RoPE type that moves its frequencies with the positions ("dynamic", "longrope"),
extra arguments (Gemma 3's layer type), positions that are not integers, autocast, and TF32
matrix products (transformers 5.17 forms the angles as a matrix product, which TF32 would
round).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nanoserve.adapters.fused_inputs import fusable
from nanoserve.adapters.modeling_classes import modeling_forward
from nanoserve.kernels.dispatch import use_triton
from nanoserve.kernels.rotary import cos_sin_problem, rotary_cos_sin


def rotary_table_module(module: torch.nn.Module, classes: Sequence[str]) -> bool:
    """One of the family's rotary embedding classes, its forward transformers' own and not
    wrapped (checked again at every call)."""
    return (
        type(module).__name__ in classes
        and "forward" not in module.__dict__
        and modeling_forward(module)
    )


def fits(module: torch.nn.Module, x, position_ids, backend: str) -> bool:
    """True when ``rotary_cos_sin`` computes what ``module``'s forward would for ``x`` (whose
    dtype the tables take) and ``position_ids`` [B, S]."""
    rope_type = getattr(module, "rope_type", None)
    inv_freq = getattr(module, "inv_freq", None)
    scaling = getattr(module, "attention_scaling", None)
    return (
        isinstance(rope_type, str)
        and "dynamic" not in rope_type
        and rope_type != "longrope"
        and modeling_forward(module)
        and isinstance(x, torch.Tensor)
        and isinstance(inv_freq, torch.Tensor)
        and fusable(x)
        and not _tf32_products()
        and isinstance(position_ids, torch.Tensor)
        and position_ids.device == x.device
        and cos_sin_problem(position_ids, inv_freq, scaling, x.dtype) is None
        and not inv_freq.requires_grad
        and use_triton(backend, x)
    )


def _tf32_products() -> bool:
    """Float32 matrix products on CUDA may round through TF32: the legacy flag says so, or
    torch refuses to read it (it does once the per-backend ``fp32_precision`` says TF32)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        return True


def rotary_table_forward(
    module: torch.nn.Module,
    backend: str,
    on_fused: Callable[[], None],
    note: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> Callable:
    """The forward that computes ``module``'s (cos, sin) in one launch where ``fits``, calling
    ``on_fused()`` each time; the class's forward otherwise. ``note(cos, sin)`` gets the
    tables of every call made with (x, position_ids) alone."""

    def forward(x, position_ids, *args, **kwargs):
        if args or kwargs:
            return type(module).forward(module, x, position_ids, *args, **kwargs)
        if fits(module, x, position_ids, backend):
            on_fused()
            tables = rotary_cos_sin(
                position_ids, module.inv_freq, module.attention_scaling, x.dtype, backend=backend
            )
        else:
            tables = type(module).forward(module, x, position_ids)
        if note is not None and isinstance(tables, tuple) and len(tables) == 2:
            note(*tables)
        return tables

    return forward
