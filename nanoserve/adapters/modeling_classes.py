"""Whether a module's class still runs the forward its transformers modeling file defines."""

from __future__ import annotations

import torch


def modeling_forward(module: torch.nn.Module) -> bool:
    """The module's class runs the forward a transformers modeling file defines for it (or
    for the class it inherits from), not one a caller or another library set on the class
    since: the family trusts a class by its name to compute its formula, and a forward
    set on the class may compute something else."""
    owner = next((c for c in type(module).__mro__ if "forward" in c.__dict__), None)
    if owner is None or not owner.__module__.startswith("transformers."):
        return False
    forward = owner.__dict__["forward"]
    return (
        getattr(forward, "__module__", None) == owner.__module__
        and getattr(forward, "__qualname__", None) == f"{owner.__qualname__}.forward"
    )
