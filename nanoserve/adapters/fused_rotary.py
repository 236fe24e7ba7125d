"""Llama's rotary embedding in one launch inside a captured decode step.

The attention modules of the Llama and Gemma families call their modeling module's global
``apply_rotary_pos_emb(q, k, cos, sin)``: in eager about ten small kernels a layer (products
on strided views, a negation and a concatenation for each of q and k, the sums). With the
``kernels`` package installed (transformers 5.25 requires it) that global is a ``kernels``
wrapper module around the same function, which an attention module routes to its own copy
of the wrapper, and which ``kernels.kernelize`` can point at a Hub kernel; a modeling module
whose attention modules hold a kernelized copy keeps its global. While
``swapped(...)`` is open that global is a stand-in that runs ``apply_rotary`` (one launch for
q and k) in the threads inside it, and the original everywhere else; the original comes back
when the last user leaves (a global someone else set meanwhile is left as they set it). The
kernel rounds where eager rounds: float16 and bfloat16 results are bit-equal to stock's.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch

from nanoserve.adapters.fused_inputs import fusable, records_grad
from nanoserve.kernels.dispatch import use_triton
from nanoserve.kernels.rotary import apply_rotary, input_problem

NAME = "apply_rotary_pos_emb"

_lock = threading.Lock()
# module name -> [original, stand-in, users]
_installed: dict[str, list] = {}
# .users: a stack of (module names, backend, on_fused, ahead) per thread
_local = threading.local()


def _own_function(module: ModuleType) -> bool:
    """The module's global is its own ``apply_rotary_pos_emb`` (not one another library
    installed, as Liger's kernels do, whose math may differ), that function in a ``kernels``
    wrapper no Hub kernel replaced, or our stand-in of it."""
    entry = _installed.get(module.__name__)
    function = getattr(module, NAME, None)
    if entry is not None and function is entry[1]:
        return True
    function = _kernels_wrapped(function) if isinstance(function, torch.nn.Module) else function
    return (
        callable(function)
        and getattr(function, "__module__", None) == module.__name__
        and getattr(function, "__name__", None) == NAME
    )


def _kernels_wrapped(wrapper: torch.nn.Module):
    """The function a ``kernels`` function wrapper (``use_kernel_forward_from_hub`` on a
    function) calls, or None when it is not one, or its forward was replaced."""
    forward = getattr(type(wrapper), "forward", None)
    if not hasattr(type(wrapper), "kernel_layer_name") or "forward" in wrapper.__dict__:
        return None
    try:
        return inspect.getclosurevars(forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return None


def _kernelized(attention: torch.nn.Module) -> bool:
    """The attention module's own ``kernels`` function wrappers (``use_kernelized_func``)
    include one ``kernels.kernelize`` pointed at a Hub kernel."""
    wrappers = attention.__dict__.get("_kernel_funcs")
    if not isinstance(wrappers, dict):
        return False
    return any(
        isinstance(w, torch.nn.Module) and _kernels_wrapped(w) is None for w in wrappers.values()
    )


def rotary_modules(attentions: Sequence[torch.nn.Module], classes: Sequence[str]):
    """The modeling modules whose global ``apply_rotary_pos_emb`` the forward of
    ``attentions`` of the family's ``classes`` calls (a class is trusted by its name to
    apply Llama's formula, as the family declares; its forward must name the global, and
    the global must be the module's own function). A module is left out when any of the
    ``attentions`` it defines is kernelized (``kernels.kernelize``)."""
    found: dict[str, ModuleType] = {}
    kernelized: set[str] = set()
    for attention in attentions:
        cls = type(attention)
        module = sys.modules.get(cls.__module__)
        if _kernelized(attention):
            kernelized.add(cls.__module__)
        if cls.__name__ not in classes or module is None or "forward" in attention.__dict__:
            continue
        forward = inspect.unwrap(cls.forward)
        code = getattr(forward, "__code__", None)
        if code is not None and NAME in code.co_names and _own_function(module):
            found[module.__name__] = module
    return tuple(m for name, m in found.items() if name not in kernelized)


def _stand_in(original: Callable, module_name: str) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # the innermost user of this thread that swapped this module
        user = next(
            (u for u in reversed(getattr(_local, "users", ())) if module_name in u[0]), None
        )
        if user is not None and not args and set(kwargs) <= {"unsqueeze_dim"}:
            _, backend, on_fused, ahead = user
            if kwargs.get("unsqueeze_dim", 1) == 1 and _fits(q, k, cos, sin, backend):
                on_fused()
                held = ahead(q, k, cos, sin) if ahead is not None else None
                if held is not None:
                    return held
                return apply_rotary(q, k, cos, sin, backend=backend)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _fits(q, k, cos, sin, backend: str) -> bool:
    """16-bit tensors outside autocast and autograd that ``apply_rotary`` takes on this
    backend."""
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not fusable(q):
        return False
    if records_grad(*tensors):
        return False  # (the kernel records no graph for backward)
    return input_problem(*tensors) is None and use_triton(backend, q)


@contextlib.contextmanager
def swapped(
    modules: Sequence[ModuleType],
    backend: str,
    on_fused: Callable[[], None],
    ahead: Callable | None = None,
) -> Iterator[None]:
    """The stand-in in ``modules`` for this thread's calls while open (``on_fused()`` is
    called for each call it runs fused; ``ahead(q, k, cos, sin)`` may give the rotated pair
    already computed, else None); other threads' calls run the original. A module
    whose global is no longer its own function (another library replaced it since) is
    left as it is. The global is the process's: while it is swapped, code compiled by
    ``torch.compile`` in another thread that calls it is compiled again."""
    with _lock:
        modules = [m for m in modules if _own_function(m)]
        for module in modules:  # every entry made before any global changes
            if module.__name__ not in _installed:
                original = getattr(module, NAME)
                _installed[module.__name__] = [original, _stand_in(original, module.__name__), 0]
        for module in modules:
            entry = _installed[module.__name__]
            if entry[2] == 0:
                setattr(module, NAME, entry[1])
            entry[2] += 1
    users = _local.__dict__.setdefault("users", [])
    users.append(({m.__name__ for m in modules}, backend, on_fused, ahead))
    try:
        yield
    finally:
        users.pop()
        with _lock:
            for module in modules:
                entry = _installed[module.__name__]
                entry[2] -= 1
                if entry[2] == 0:
                    del _installed[module.__name__]
                    if getattr(module, NAME) is entry[1]:
                        setattr(module, NAME, entry[0])
