"""The supported model families. A new family is a small file defining a ``Family`` (see
``llama.py``) plus one entry in ``FAMILIES``."""

from __future__ import annotations

from nanoserve.adapters.dense import DENSE
from nanoserve.adapters.family import Family
from nanoserve.adapters.gemma import GEMMA
from nanoserve.adapters.llama import LLAMA
from nanoserve.adapters.moe import MOE
from nanoserve.adapters.phi3 import PHI3

FAMILIES: tuple[Family, ...] = (LLAMA, GEMMA, PHI3, DENSE, MOE)


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(config) -> Family:
    """The family serving ``config.model_type``; NotImplementedError names those supported."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            if family.check is not None:
                family.check(config)
            return family
    raise NotImplementedError(
        f"nanoserve does not support model_type {model_type!r}; supported: "
        + ", ".join(supported_model_types())
    )
