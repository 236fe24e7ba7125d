"""Forward hooks and wrapped forwards on a patched model, and which of nanoserve's shortcuts
each one would change.

Stock runs every hook at every forward, on the whole batch. Three shortcuts would not:

- A CUDA-graph replay runs no Python: a hook or wrapper on a submodule (or a global hook)
  would run only while its step is captured.
- Prefix sharing gives a row the K/V that another row, or an earlier call, computed: a hook
  on a submodule may compute each row differently (by its batch index) or each call
  differently (by its own state), and no key can name that.
- nanoserve's decode loop drops finished rows from the batch: any hook, one on the model
  itself included, would see fewer rows than stock shows it. It also runs a few forwards
  past a stop before it reads the stop back.

A parametrized module in training mode (whose weights, computed at every forward, may
update state, as ``spectral_norm``'s power iteration does) counts as all three: no forward
runs that stock would not (a shared prefix computed apart, a capture's warm-up, steps past a
stop).

Exempt: the hooks a replay may skip (``REPLAY_SAFE_HOOKS``), and accelerate's hooks that
only move or cast tensors (device maps, offload), which change no value a row computes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.nn.modules import module as _torch_module

# Hooks and forward wrappers a replay may skip, by "module.qualname" prefix: tensor
# parallelism's (torch.distributed.tensor's hooks, transformers' wrapped forwards: the
# collectives they add are captured in the graph),
# transformers' output capturing (installed for good by a forward that asked for hidden
# states or attentions, inactive in any other forward; those never replay a graph), and
# enable_input_require_grads' (marks the embeddings' output for autograd, which generate
# does not run)
REPLAY_SAFE_HOOKS = (
    "torch.distributed.tensor.",
    "transformers.distributed.tensor_parallel.",
    "transformers.utils.output_capturing.",
    "transformers.modeling_utils.PreTrainedModel.enable_input_require_grads.",
)
# accelerate's hooks (``module._hf_hook``, run by a wrapped forward) that move weights and
# activations between devices or cast them, the same way for every row and call
_VALUE_NEUTRAL_ACCELERATE_HOOKS = ("AlignDevicesHook", "CpuOffload", "LayerwiseCastingHook")


class HookScan(NamedTuple):
    """What a model's hooks rule out, each as a phrase naming the first hook found, or None.

    ``replay``: a replayed step would skip it. ``rows``: it may change what a row computes
    (no prefix sharing). ``batch``: it would see the batch that nanoserve's decode loop
    shrinks (HF's loop runs)."""

    replay: str | None = None
    rows: str | None = None
    batch: str | None = None


def scan_hooks(model, named=None) -> HookScan:
    """Walk ``model``'s modules once for forward hooks, pre-hooks and wrapped forwards (and
    the global hooks); see ``HookScan``. On the model itself its hooks count, and the
    caller's code that runs with its forward (``model_forward_code``). ``named``:
    ``model.named_modules()`` when already listed (``ModelWalk``)."""
    global_hooks = (
        *_torch_module._global_forward_hooks.values(),
        *_torch_module._global_forward_pre_hooks.values(),
    )
    if any(not _replay_safe(h) for h in global_hooks):
        phrase = "a global forward hook (register_module_forward_hook)"
        return HookScan(phrase, phrase, phrase)
    replay = rows = batch = None
    for name, module in model.named_modules() if named is None else named:
        hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
        if not name:  # the model itself: its hooks run around its forward, replay or not
            if any(not _neutral(h, module) for h in hooks):
                batch = batch or "a forward hook on the model"
            inside, around = model_forward_code(module)
            if inside is not None:
                replay, rows, batch = replay or inside, rows or inside, batch or inside
            if around is not None:
                batch = batch or around
            continue
        if module.training and "parametrizations" in module._modules:
            # its weights computed at each forward may update state (spectral_norm's power
            # iteration does in training mode): no forward stock would not run (a common
            # prefix computed apart, a capture's warm-up, steps past a stop)
            phrase = f"a parametrization on {name} in training mode"
            replay, rows, batch = replay or phrase, rows or phrase, batch or phrase
        forward = module.__dict__.get("forward")
        unsafe = [(h, "forward hook") for h in hooks if not _replay_safe(h)]
        if forward is not None and not own_forward(forward, module) and not _replay_safe(forward):
            unsafe.append((forward, "wrapped forward"))
        if unsafe and replay is None:
            replay = f"a {unsafe[0][1]} on {name}"
        changing = [kind for h, kind in unsafe if not _neutral(h, module)]
        if changing and rows is None:
            rows = f"a {changing[0]} on {name}"
            batch = batch or rows
        if replay is not None and rows is not None and batch is not None:
            break
    return HookScan(replay, rows, batch)


# where the model class's own forward may come from: transformers' modeling code (a class
# built on it without a forward of its own inherits it)
_LIBRARY_FORWARDS = ("transformers.",)
# wrappers of a model's forward that change no row's values: accelerate's output casts
# (Accelerator.prepare) and torch's autocast decorator
_NEUTRAL_FORWARD_WRAPPERS = ("accelerate.", "torch.")


def model_forward_code(model) -> tuple[str | None, str | None]:
    """Code of the caller's that runs with the patched model's forward, as phrases (None:
    none). ``inside``: a forward the patched one calls at every step, so that replays,
    shared rows and the decode loop's batch would all reach it: a class forward written
    outside transformers (a subclass overriding ``forward``) or a wrapper set on the model
    before ``patch_model``. ``around``: a wrapper set on ``model.forward`` after patching,
    which runs around every step and sees the batch nanoserve's decode loop shrinks."""
    from nanoserve.adapters.step import state_of  # (step imports the graph modules)

    state = state_of(model)
    inside = around = None
    class_forward = getattr(type(model), "forward", None)
    where = getattr(class_forward, "__module__", None) or ""
    if class_forward is not None and not where.startswith(_LIBRARY_FORWARDS):
        inside = f"{type(model).__name__}.forward (a class forward of the caller's)"
    previous = getattr(state, "previous_forward", None)
    if inside is None and previous is not None and not _neutral_forward(previous, model):
        inside = "a wrapper set on model.forward before patch_model"
    current = model.__dict__.get("forward")
    if state is None or current is None:
        return inside, around
    if is_accelerate_wrapper(current, model):  # accelerate's hooks added after patching
        if not _value_neutral_hooks(model):
            around = "accelerate hooks of the caller's on the model"
        current = model.__dict__.get("_old_forward")
    if getattr(current, "__func__", None) is not state.patched_forward and not (
        own_forward(current, model) or _neutral_forward(current, model)
    ):
        around = around or "a wrapper set on model.forward after patch_model"
    return inside, around


def _neutral_forward(forward, module) -> bool:
    """A forward held by ``module`` that computes what the class's own does, row by row: the
    class's own, a replay-safe wrapper (``REPLAY_SAFE_HOOKS``), accelerate's device and cast
    hooks around such a forward, an output cast or autocast (``_NEUTRAL_FORWARD_WRAPPERS``)."""
    if own_forward(forward, module) or _replay_safe(forward):
        return True
    if is_accelerate_wrapper(forward, module):  # what it wraps counts too
        inner = module.__dict__.get("_old_forward")
        return _value_neutral_hooks(module) and _neutral_forward(inner, module)
    function = _unwrapped(getattr(forward, "__func__", forward))
    where = getattr(function, "__module__", None) or type(function).__module__
    return where.startswith(_NEUTRAL_FORWARD_WRAPPERS)


def _unwrapped(hook):
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _replay_safe(hook) -> bool:
    """A hook or forward wrapper of ``REPLAY_SAFE_HOOKS`` (partials unwrapped)."""
    hook = _unwrapped(hook)
    module = getattr(hook, "__module__", None) or ""
    name = f"{module}.{getattr(hook, '__qualname__', '')}"
    return name.startswith(REPLAY_SAFE_HOOKS)


def own_forward(forward, module) -> bool:
    """Whether ``forward`` (held in ``module.__dict__``) is the module's class forward bound
    to the module itself (or a ``functools.partial`` of it over the module): what
    ``module(...)`` runs without it (accelerate's ``remove_hook_from_module`` leaves one on
    every module it unhooked)."""
    if isinstance(forward, functools.partial):
        bound_to = forward.args[0] if len(forward.args) == 1 and not forward.keywords else None
        function = forward.func
    else:
        bound_to, function = getattr(forward, "__self__", None), getattr(forward, "__func__", None)
    return bound_to is module and function is getattr(type(module), "forward", None)


def is_accelerate_wrapper(forward, module) -> bool:
    """Whether ``forward`` is accelerate's hooked forward on ``module`` (the one
    ``add_hook_to_module`` installs), which runs ``module._hf_hook`` around
    ``module._old_forward`` (not any callable of accelerate's: ``Accelerator.prepare``
    wraps a forward to cast its outputs)."""
    function = _unwrapped(forward)
    return (
        getattr(function, "__module__", None) == "accelerate.hooks"
        and getattr(function, "__qualname__", None) == "add_hook_to_module.<locals>.new_forward"
        and "_old_forward" in module.__dict__
    )


def _neutral(hook, module) -> bool:
    """A hook or wrapper that changes no value a row computes: replay-safe ones, and
    accelerate's wrapped forward where every hook it runs is a device or cast hook and the
    forward it wraps is the module's own (not one a user set before accelerate wrapped it)."""
    if _replay_safe(hook):
        return True
    if not (getattr(_unwrapped(hook), "__module__", None) or "").startswith("accelerate."):
        return False
    if hook is module.__dict__.get("forward") and not (
        is_accelerate_wrapper(hook, module) and own_forward(module._old_forward, module)
    ):
        return False
    return _value_neutral_hooks(module)


def _value_neutral_hooks(module) -> bool:
    """Whether accelerate's hooks attached to ``module`` (``_hf_hook``) are all device or
    cast hooks (``_VALUE_NEUTRAL_ACCELERATE_HOOKS``)."""
    attached = module.__dict__.get("_hf_hook")
    parts = getattr(attached, "hooks", (attached,))  # accelerate's SequentialHook
    return attached is not None and all(
        type(h).__module__.startswith("accelerate.")
        and type(h).__name__ in _VALUE_NEUTRAL_ACCELERATE_HOOKS
        for h in parts
    )


def plain_call(model) -> bool:
    """Whether ``model(...)`` runs ``model.forward(...)`` and nothing around it: no hook of
    any kind on the model, no global module hook, no compiled call (``model.compile()``),
    and the class keeps ``nn.Module.__call__`` (PyTorch's fast path of the call)."""
    return not (
        model._forward_hooks
        or model._forward_pre_hooks
        or model._backward_hooks
        or model._backward_pre_hooks
        or _torch_module._global_forward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks
        or _torch_module._global_backward_pre_hooks
        or getattr(model, "_compiled_call_impl", None) is not None
        or type(model).__call__ is not torch.nn.Module.__call__
    )
