"""Attribute reads in walks over every module of a model, done at each generate call.

``getattr(module, name, default)`` on an ``nn.Module`` that lacks ``name`` goes through
``Module.__getattr__``, which formats and raises an AttributeError: a few microseconds a
module, a millisecond a walk of a billion-parameter model, paid by every call.
"""

from __future__ import annotations

import torch

_MISSING = object()


def module_attr(module: torch.nn.Module, name: str, default=None):
    """``getattr(module, name, default)`` without the exception where ``name`` is missing:
    the instance's own attribute, else a class attribute (properties run as usual; one that
    raises reads as missing: stock's forward does not read it), else a parameter, buffer or
    submodule of that name, else ``default``."""
    value = module.__dict__.get(name, _MISSING)
    if value is not _MISSING:
        return value
    if hasattr(type(module), name):
        try:
            return getattr(module, name, default)
        except Exception:
            return default
    for table_name in ("_parameters", "_buffers", "_modules"):
        table = module.__dict__.get(table_name)
        # (a scripted module's tables are torch.jit wrappers: no .get, but ``in`` and [])
        if table is not None and name in table:
            return table[name]
    return default
