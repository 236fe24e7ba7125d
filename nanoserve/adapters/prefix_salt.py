"""What names a call's cached prefixes beside their tokens: the prefix salt.

A block stored by an earlier call may be served to a later one only if the later call would
have computed the same K/V for it. Besides the tokens and their positions (the chained
digests of ``nanoserve.cache.prefix``), K/V depend on everything the forward reads: the
weights and buffers (their values, not only their versions), the modules that make up the
model and the plain attributes their forwards read (a norm's eps, an attention's scaling, a
rotary module's attention scaling, a swapped activation), the config those forwards read
(Mistral's sliding window), adapters switched on, the dtype, and the caller's
``cache_salt``. ``prefix_salt`` reads all of that once a call and digests it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import logging
import types
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch.nn.modules import module as _module_hooks
from transformers import PretrainedConfig

from nanoserve.adapters.module_attrs import module_attr
from nanoserve.adapters.numeric_modes import numeric_modes
from nanoserve.kernels.content_hash import DigestPlan, PendingDigest, kernel_runs_on
from nanoserve.log import get_logger

if TYPE_CHECKING:
    from nanoserve.adapters.model_walk import ModelWalk

_log = get_logger(__name__)
_NONE = object()
# attribute values read as they are (their repr names them)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_SCALARS = {type(None), bool, int, float, str}
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
# containers are read this deep; an attribute holding any other object is not read
_DEPTH = 4


class PendingSalt(NamedTuple):
    """``begin_prefix_salt``'s result: why K/V cannot be named across calls (None when they
    can), the tensors' layout and their fingerprint's work (per device: a ``PendingDigest``
    still on the device, or the values already read)."""

    reason: str | None
    layout: tuple
    values: tuple


def prefix_salt(model, user_salt, state, walk: ModelWalk | None = None) -> bytes | None:
    """What names a call's cached prefixes beside their tokens (16 bytes), or None when K/V
    cannot be named across calls (``unnameable``: then only copies within the call share).

    The key: every parameter, buffer and public tensor attribute (address, in-place
    version, dtype, shape, and a fingerprint of its values, ``_fingerprint``, read once a
    call: fused optimizers and writes through ``.data`` change values without a new
    version), the model's structure (``structure_key``), torch's settings that change what
    a forward computes (autocast, matmul precision: ``numeric_modes``) and the caller's
    ``cache_salt``. The digest of the model's part of the last key is kept on ``state`` (a
    ``PatchState``); under tensor parallelism the caller joins the ranks' digests into one
    (``tensor_parallel.agreed_salt``). ``walk``: the call's ``ModelWalk``, whose module list
    (and structure) is read instead of walking again. In two halves, ``begin_prefix_salt``
    and ``finish_prefix_salt``, the device hashes the weights while the host does other
    work between them."""
    return finish_prefix_salt(begin_prefix_salt(model, state, walk), model, user_salt, state, walk)


def begin_prefix_salt(model, state, walk: ModelWalk | None = None) -> PendingSalt:
    """``prefix_salt``'s first half: reads the tensors' layout and queues their fingerprint
    (a hash kernel on CUDA), without waiting for it and without changing ``state``'s key
    (its ``digest_plans``, the hash's layout kept for the next call, may change)."""
    reason = unnameable(model, walk)
    if reason is not None:
        return PendingSalt(reason, (), ())
    tensors, layout = [], []
    modules = walk.modules if walk is not None else list(model.modules())
    seen = {id(module) for module in modules}  # a module in a container is read once, apart
    # every module once; parameters() and buffers() would walk them twice
    covered: set[int] = set()  # ids of the meta tensors whose values an offload map holds
    for module in modules:  # (a module before its submodules)
        offloaded = _offloaded_values(module, covered)
        for t in _module_tensors(module, seen):
            tensors += _value_views(t)
            layout.append(_tensor_layout(t, id(t) in covered))
        for t in offloaded:  # fresh tensors from disk: no address named
            tensors += _value_views(t)
            layout.append((t.dtype, tuple(t.shape), _version(t)))
    plans = state.digest_plans
    return PendingSalt(None, tuple(layout), _start_fingerprint(tensors, state.backend, plans))


def _module_tensors(module, seen: set) -> list[torch.Tensor]:
    """``module``'s own parameters and buffers (not its submodules') and the tensors of
    ``_tensor_attributes(module, seen)``."""
    held = (*module._parameters.values(), *module._buffers.values())
    return [t for t in held if t is not None] + _tensor_attributes(module, seen)


def _offloaded_values(module, covered: set) -> list[torch.Tensor]:
    """The values of the tensors accelerate offloaded from ``module`` (left on the meta
    device; an ``AlignDevicesHook`` copies them in from its ``weights_map``, a state dict or
    files on disk, before each forward), read from the map as that forward will: an edit
    there changes what the model computes and no parameter shows it. Adds the ids of the
    meta tensors so read to ``covered``."""
    outer = getattr(module, "_hf_hook", None)
    found = []
    for hook in getattr(outer, "hooks", (outer,)) if outer is not None else ():
        weights = getattr(hook, "weights_map", None)
        if not getattr(hook, "offload", False) or weights is None:
            continue
        from accelerate.utils import named_module_tensors

        for name, held in named_module_tensors(
            module,
            include_buffers=bool(getattr(hook, "offload_buffers", False)),
            recurse=bool(getattr(hook, "place_submodules", False)),
            remove_non_persistent=True,
        ):
            value = weights[name]
            if isinstance(value, torch.Tensor):
                found.append(value)
                if held.device.type == "meta":
                    covered.add(id(held))
    return found


def _tensor_attributes(module, seen: set) -> list[torch.Tensor]:
    """A module's public tensors held as plain attributes or in containers (lists, tuples,
    sets, dicts, to ``_DEPTH``), neither parameter nor buffer: a scale a custom layer reads,
    a rotary module's ``original_inv_freq``; and every tensor of a module held in such a
    container (not registered: no walk reaches its parameters). Their values are
    fingerprinted with the weights, as a write through ``.data`` keeps their version.
    ``seen``: ids of the modules read otherwise (the model's own: the walk reads them),
    to which the modules found are added (one held twice, or holding itself, read once)."""
    found = []
    for name, value in module.__dict__.items():
        if name[0] == "_":
            continue
        kind = type(value)  # (isinstance on a dead weakref.proxy raises)
        if issubclass(kind, torch.Tensor):
            found.append(value)
        elif _is_container(value):
            _tensors_held(value, found, 1, seen)
    return found


_CONTAINERS = (list, tuple, dict, set, frozenset)


def _is_container(value) -> bool:
    """Whether ``value`` is one of ``_CONTAINERS`` (a subclass too)."""
    kind = type(value)
    if kind in _CONTAINERS or kind in _SCALARS:  # (the common cases, without isinstance)
        return kind in _CONTAINERS
    try:
        return isinstance(value, _CONTAINERS)
    except Exception:  # (a dead weakref.proxy)
        return False


def _tensors_held(value, found: list, depth: int, seen: set) -> None:
    """Appends to ``found`` the tensors in container ``value`` and, of each module in it,
    its parameters, buffers and tensor attributes, and its submodules'."""
    if depth > _DEPTH:
        return
    try:
        items = list(value.values() if isinstance(value, dict) else value)
    except Exception:  # (a container of its own kind whose iteration raises: not read)
        return
    for item in items:
        kind = type(item)
        if issubclass(kind, torch.Tensor):
            found.append(item)
        elif issubclass(kind, torch.nn.Module):
            for sub in item.modules():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found += _module_tensors(sub, seen)
        elif _is_container(item):
            _tensors_held(item, found, depth + 1, seen)


def tensor_place(t: torch.Tensor) -> tuple:
    """Where a tensor's values lie: (address, dtype, shape, layout); sparse and nested
    tensors have no single address, nested ones no shape: None there."""
    try:
        address = t.data_ptr()
    except RuntimeError:
        address = None
    try:
        shape = tuple(t.shape)
    except RuntimeError:
        shape = None
    return (address, t.dtype, shape, t.layout)


def _tensor_layout(t: torch.Tensor, offloaded: bool = False) -> tuple:
    """``tensor_place`` and the tensor's in-place version; of a tensor accelerate
    ``offloaded`` (whose values ``_offloaded_values`` reads from its map) only its dtype and
    shape: accelerate bumps its version as it moves the values in and out."""
    if offloaded:
        return ("offloaded", t.dtype, tuple(t.shape))
    return (*tensor_place(t), _version(t))


def _value_views(t: torch.Tensor) -> list[torch.Tensor]:
    """Dense tensors whose values are ``t``'s, to fingerprint: ``t`` itself, a quantized
    tensor's integers and scales, a sparse tensor's indices and values (a nested tensor's,
    unread: named by its layout only)."""
    if t.is_quantized:
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            scale = torch.tensor(
                [t.q_scale(), float(t.q_zero_point())], dtype=torch.float64, device="cpu"
            )
        else:
            scale = torch.cat([t.q_per_channel_scales(), t.q_per_channel_zero_points()])
        return [t.int_repr(), scale.to(t.device)]
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed, plain = (
            (t.crow_indices(), t.col_indices())
            if t.layout in (torch.sparse_csr, torch.sparse_bsr)
            else (t.ccol_indices(), t.row_indices())
        )
        return [compressed, plain, t.values()]
    if t.layout != torch.strided or t.is_nested:
        return []
    return [t]


def finish_prefix_salt(
    pending: PendingSalt, model, user_salt, state, walk: ModelWalk | None = None
) -> bytes | None:
    """``prefix_salt``'s second half, from ``begin_prefix_salt(model, state, walk)``'s
    result: reads the fingerprint back and digests the key."""
    if pending.reason is not None:
        if state.salt_key != pending.reason:
            state.salt_key = pending.reason
            _log.info("prefix cache: no prefix found across calls (%s)", pending.reason)
        return None
    structure = walk.structure if walk is not None else structure_key(model)
    values = _read_fingerprint(pending.values)
    key = (pending.layout, values, structure, numeric_modes())
    # the model's part is printed and digested only when it changed (a caller's salt that
    # changes every call then costs one small digest)
    if state.salt_key != key:
        if isinstance(state.salt_key, tuple) and _log.isEnabledFor(logging.INFO):
            _log.info(
                "prefix cache: %s changed since the last call; prefixes stored before are "
                "not found",
                _what_changed(state.salt_key, key),
            )
        state.salt_key = key
        state.salt = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    return hashlib.blake2b(state.salt + repr(user_salt).encode(), digest_size=16).digest()


def _what_changed(old: tuple, new: tuple) -> str:
    """Which part of a salt key differs between two calls, as a phrase for the log: a
    timing wrapper whose state changes every call, or weights trained in place, make every
    call miss what the one before stored."""
    layout, values, structure, modes = (a != b for a, b in zip(old, new, strict=True))
    if structure:
        return _structure_change(old[2], new[2])
    if layout:
        return "a tensor's address, dtype, shape or in-place version (weights updated?)"
    if values:
        return "the weights' values"
    return "torch's numeric modes (autocast, matmul precision)" if modes else "nothing"


def _structure_change(old: tuple, new: tuple) -> str:
    """``_what_changed`` within ``structure_key``'s tuple."""
    switches, classes, settings, global_hooks, dtype, code = (
        a != b for a, b in zip(old, new, strict=True)
    )
    if classes:
        for (name, attrs), (new_name, new_attrs) in zip(old[1], new[1], strict=False):
            name, new_name = name.rsplit(".", 1)[-1], new_name.rsplit(".", 1)[-1]
            if name != new_name:
                return f"a module's class ({name} -> {new_name})"
            if attrs != new_attrs:
                before, after = dict(attrs), dict(new_attrs)
                names = [n for n in {**before, **after} if before.get(n) != after.get(n)]
                return f"{name}.{names[0]}" if names else f"an attribute of {name}"
        return "the model's modules"
    if settings:
        return "a config setting"
    if switches or global_hooks:
        return "the forward hooks or the adapters switched on"
    return "the model's dtype" if dtype else "a module class's forward code"


def structure_key(model, modules=None) -> tuple:
    """What ``model``'s forward reads besides its tensors' values, as a comparable, printable
    tuple: every module's class and public plain attributes (``_attributes``: a swapped
    activation, a norm's eps, an attention's scaling), the public settings of every config a
    module holds and the model's, the forward hooks registered on any module and globally
    (handle ids: adding or removing one changes it), the adapters each tuner layer has on
    (peft) and the model's dtype. ``modules``: ``model.modules()`` when already listed."""
    switches, classes = [], []
    configs: dict[int, PretrainedConfig] = {}
    forwards: dict[type, None] = {}  # the classes, in order
    for number, module in enumerate(model.modules() if modules is None else modules):
        hooks = (*module._forward_pre_hooks, *module._forward_hooks)
        # (transformers' PeftAdapterMixin.active_adapters is a method, a peft layer's a list)
        active = module_attr(module, "active_adapters", _NONE)
        if hooks or (active is not _NONE and not callable(active)):
            switches.append((number, hooks, _adapters_on(module)))
        classes.append((_class_name(type(module)), _attributes(module, configs)))
        forwards.setdefault(type(module), None)
    configs.setdefault(id(model.config), model.config)
    settings = tuple(_plain(_public(c), 0) for c in configs.values())
    global_hooks = (*_module_hooks._global_forward_pre_hooks, *_module_hooks._global_forward_hooks)
    # what each class's forward runs: a class patched between calls computes other K/V
    code = tuple(_class_forward(cls) for cls in forwards)
    return tuple(switches), tuple(classes), settings, global_hooks, model.dtype, code


# a class's forward function -> what it runs (read once: a class is patched by assigning a
# new function, which is read anew)
_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _class_forward(cls: type):
    forward = getattr(cls, "forward", None)
    try:
        return _FORWARDS[forward]
    except (KeyError, TypeError):  # (TypeError: not weakly referable, read each call)
        pass
    key = _plain(forward, 0)
    with contextlib.suppress(TypeError):
        _FORWARDS[forward] = key
    return key


def unnameable(model, walk: ModelWalk | None = None) -> str | None:
    """Why K/V of this model cannot be named by tokens and weights alone (a phrase), or None:
    rotary frequencies that depend on the call's length (``length_dependent_rope``: a later
    call of another length computes other K for the same prefix), or a module that drops
    out at random (training mode, ``drops_out``). ``walk``: the call's ``ModelWalk``."""
    if walk is not None:
        return walk.rope or walk.dropout
    return length_dependent_rope(model) or drops_out(model)


def length_dependent_rope(model, modules=None) -> str | None:
    """Which rotary type of ``model`` sets its frequencies from the longest position in the
    batch (``dynamic``, ``longrope``: transformers' ``dynamic_rope_update``), as a phrase, or
    None. Such a model computes other K/V for a row when the batch's other rows change.
    ``modules``: the model's modules when already listed (``ModelWalk``)."""
    for module in model.modules() if modules is None else modules:
        kind = module_attr(module, "rope_type")
        kinds = kind.values() if isinstance(kind, dict) else [kind]
        for kind in kinds:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return f"rope_type {kind!r}: its frequencies depend on the call's length"
    return None


def drops_out(model, modules=None) -> str | None:
    """Which module of ``model`` drops out at random (training mode, a rate above 0), as a
    phrase, or None. Such a model computes other K/V and logits for each copy of a prompt,
    so no row may take another's. ``modules``: the model's modules when already listed."""
    for module in model.modules() if modules is None else modules:
        if module.training and _dropout_rate(module) > 0:
            return f"{type(module).__name__} drops out at random in training mode"
    return None


_DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def attention_dropout_rate(module) -> float:
    """``module.attention_dropout`` where it is a number (what its attention is asked to
    drop in training mode), else 0.0."""
    rate = module_attr(module, "attention_dropout", 0.0)
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else 0.0


def _dropout_rate(module) -> float:
    """A dropout module's rate, or the largest rate of randomness a module keeps for its own
    forward in training mode: ``attention_dropout``, ``p`` of a class named like a dropout,
    and any public number (or dict of numbers) named like a dropout rate (Starcoder2's
    ``residual_dropout`` / ``embedding_dropout`` for ``F.dropout``, GPT-2-style
    ``resid_pdrop``) or a jitter (Mixtral's ``jitter_noise`` scales the router's input by
    uniform noise)."""
    if isinstance(module, _DROPOUT_MODULES):
        return float(module.p)
    rates = [attention_dropout_rate(module)]
    if "Dropout" in type(module).__name__:  # one of a library's own (peft's OFT: ``p``)
        rates.append(module_attr(module, "p", 0.0))
    for name, value in module.__dict__.items():
        if name[0] != "_" and ("dropout" in name or "jitter" in name or name.endswith("pdrop")):
            # one rate, or one per adapter (peft's LoHa and LoKr keep dicts of them)
            rates.extend(value.values() if isinstance(value, dict) else [value])
    numbers = (r for r in rates if isinstance(r, (int, float)) and not isinstance(r, bool))
    return max(map(float, numbers), default=0.0)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version: their values are compared
        return None


def _adapters_on(module) -> tuple:
    """A tuner layer's (peft) switches: adapters disabled, active and merged."""
    return tuple(
        _plain(module_attr(module, name, default), 1)
        for name, default in (
            ("disable_adapters", False),
            ("active_adapters", ()),
            ("merged_adapters", ()),
        )
    )


def _fingerprint(tensors: list[torch.Tensor], backend: str = "auto") -> tuple:
    """What the values of ``tensors`` are, per device. Where the Triton kernels run (CUDA, or
    the interpreter with ``backend="triton"``): ``content_digest``, a hash of every byte at
    its place (any changed byte changes it). Elsewhere (CPU): ``_float_fingerprint``."""
    return _read_fingerprint(_start_fingerprint(tensors, backend))


def _start_fingerprint(
    tensors: list[torch.Tensor], backend: str = "auto", plans: dict | None = None
) -> tuple:
    """``_fingerprint``'s work: per device a ``PendingDigest`` (the hash queued, not read) or
    the float fingerprint's values. ``plans``: {device: ``DigestPlan``} of the last call,
    launched again where the tensors still lie as planned, replaced where not."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        if t.device.type != "meta" and t.numel():
            per_device.setdefault(t.device, []).append(t.detach())
    prints = []
    for device, group in per_device.items():
        if not kernel_runs_on(backend, device):
            prints.append(_float_fingerprint(device, group))
            continue
        plan = plans.get(device) if plans is not None else None
        if plan is None or not plan.fits(group):
            plan = DigestPlan(group, backend=backend)
            if plans is not None and plan.reusable:
                plans[device] = plan
            elif plans is not None:  # (a plan of copies holds them: not kept)
                plans.pop(device, None)
        prints.append(plan.launch())
    return tuple(prints)


def _read_fingerprint(prints: tuple) -> tuple:
    """``_start_fingerprint``'s result with every digest read back."""
    return tuple(p.result() if isinstance(p, PendingDigest) else p for p in prints)


def _float_fingerprint(device: torch.device, tensors: list[torch.Tensor]) -> tuple:
    """Two position-weighted sums over every tensor's row sums and column sums (a tensor of
    more dimensions read as [first dim, the rest]; complex values as pairs of reals;
    one-byte and non-float dtypes by their raw values), read back with one copy. A changed
    value changes them beyond float rounding, and so does a write that keeps each tensor's
    total and norm, such as reordered rows, heads or columns (the weights differ by
    position). Each row or column sum enters squashed to a signed logarithm, with NaN and
    infinities as fixed values, so that a mask of -inf or a huge buffer cannot drown the
    rest. Not a hash: changes made to cancel can pass, and so can a change below float
    rounding of a large sum."""
    sums = []
    for t in tensors:
        if t.is_complex():
            t = torch.view_as_real(t.resolve_conj())  # (rotary tables kept as complex)
        if t.element_size() == 1:
            t = t.view(torch.uint8)
        # a reduction widens its input to the accumulation dtype first, except 16-bit floats
        # into float32 on CUDA: a float64 sum would copy every weight to float64
        wide = t.dtype == torch.float64 or not t.is_floating_point()
        dtype = torch.float64 if wide else torch.float32
        grid = t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)
        sums += [grid.sum(dim=1, dtype=dtype).double(), grid.sum(dim=0, dtype=dtype).double()]
    flat = torch.nan_to_num(torch.cat(sums), nan=0.5, posinf=1e300, neginf=-1e300)
    flat = torch.sign(flat) * torch.log1p(flat.abs())
    position = torch.arange(flat.numel(), dtype=torch.float64, device=device)
    first = (flat * (torch.sin(position * 0.6180339887498949) + 1.5)).sum()
    second = (flat * (torch.cos(position * 1.4142135623730951) + 1.5)).sum()
    return tuple(torch.stack([first, second]).cpu().tolist())


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _attributes(module, configs: dict) -> tuple:
    """(name, value) of ``module``'s public attributes that its forward may read besides its
    tensors: plain values (``_plain``), functions by name, tensors by address and version.
    Configs are gathered into ``configs`` (read once each, by the caller); other objects are
    not read. ``training`` is left out (dropout is ``drops_out``'s)."""
    found = []
    for name, value in module.__dict__.items():
        if name[0] == "_" or name == "training":
            continue
        if type(value) in _SCALARS:  # most attributes: taken without more checks
            found.append((name, value))
            continue
        try:
            if isinstance(value, PretrainedConfig):
                configs.setdefault(id(value), value)
                continue
            plain = _plain(value, 0)
        except Exception:  # (a dead weakref.proxy, a key whose repr raises: not read)
            plain = ("unreadable", _class_name(type(value)))
        if plain is not _NONE:
            found.append((name, plain))
    return tuple(found)


def _public(config: PretrainedConfig) -> dict:
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def _plain(value, depth: int, objects: bool = False):
    """A comparable, printable stand-in for ``value``, or ``_NONE`` for an object not read:
    plain values as they are, containers of them (to ``_DEPTH``), nested configs by their
    public settings, callables by what they run (``_callable``), tensors by address,
    version, dtype and shape (a plain tensor attribute's values are fingerprinted with the
    weights), callable objects (and, with ``objects``, any object: a bound method's owner, a
    value a closure holds) by class and public attributes (``_object``)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", *_tensor_layout(value))
    if isinstance(value, (np.ndarray, np.generic)):
        return _numpy(value)
    if isinstance(value, _CALLABLES):
        return _callable(value, depth)
    if depth >= _DEPTH:
        return _NONE
    if isinstance(value, PretrainedConfig):
        value = _public(value)
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_plain(v, depth + 1, objects) for v in value]
        if isinstance(value, (set, frozenset)):
            items.sort(key=repr)
        return (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        items = sorted(((repr(k), v) for k, v in value.items()), key=lambda item: item[0])
        return ("dict", tuple((k, _plain(v, depth + 1, objects)) for k, v in items))
    if isinstance(value, (types.ModuleType, type)):
        return (type(value).__name__, getattr(value, "__name__", None))
    config_like = isinstance(value, types.SimpleNamespace) or dataclasses.is_dataclass(value)
    return _object(value, depth) if objects or config_like or callable(value) else _NONE


def _numpy(value) -> tuple:
    """A numpy array or scalar by dtype, shape and a digest of its bytes (object arrays,
    whose bytes are addresses: by shape only)."""
    if value.dtype.hasobject:
        return ("numpy", str(value.dtype), value.shape, _NONE)
    data = np.ascontiguousarray(value).tobytes()
    return ("numpy", str(value.dtype), value.shape, hashlib.blake2b(data, digest_size=16).digest())


def _object(value, depth: int):
    """An object a forward may call or read (a bound method's owner, a callable object, a
    value a closure holds): its class and its public attributes, to ``_DEPTH``; of a
    module (an activation module whose ``forward`` is held, or the model's own) its plain
    values and tensors only (its submodules and the rest are the walk's when they are the
    model's, and a patched model's own methods would read the whole model again)."""
    attributes = getattr(value, "__dict__", None)
    # (a ufunc or a compiled function holds no attributes that tell it from another: its name)
    label = getattr(value, "__qualname__", getattr(value, "__name__", None))
    kind = (_class_name(type(value)), label if isinstance(label, str) else None)
    if depth >= _DEPTH or not isinstance(attributes, dict):
        return (*kind, _NONE)
    module = isinstance(value, torch.nn.Module)
    read = tuple(
        (name, _plain(v, depth + 1))
        for name, v in attributes.items()
        if name[0] != "_"
        and name != "training"
        and (not module or isinstance(v, (*_PLAIN, torch.Tensor)))
    )
    wrapped = attributes.get("__wrapped__")  # functools.wraps: what the wrapper calls
    if wrapped is not None:
        read += (("__wrapped__", _plain(wrapped, depth + 1, True)),)
    return (*kind, read, _script_code(value))


def _script_code(value) -> str | None:
    """A TorchScript function's or module's code (its Python attributes say nothing)."""
    if isinstance(value, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        with contextlib.suppress(Exception):
            return value.code
    return None


def _callable(value, depth: int):
    """What a callable attribute runs: a function by module, name, code (its bytecode,
    constants and the names it looks up), defaults and the values its closure holds; a
    partial by its function and arguments; a bound method by its function and owner. (A
    lambda swapped for another, or one closed over another value, names other K/V.) Past
    ``_DEPTH`` only the name."""
    func = getattr(value, "__func__", value)
    name = (getattr(func, "__module__", None), getattr(func, "__qualname__", None))
    if depth >= _DEPTH:
        return ("callable", *name)
    if isinstance(value, functools.partial):
        arguments = tuple(_plain(a, depth + 1, True) for a in value.args)
        keywords = tuple(sorted((k, _plain(v, depth + 1, True)) for k, v in value.keywords.items()))
        return ("partial", _plain(value.func, depth + 1), arguments, keywords)
    owner = getattr(value, "__self__", None)
    if isinstance(value, types.MethodType) or (
        isinstance(value, types.BuiltinMethodType) and owner is not None
        and not isinstance(owner, types.ModuleType)
    ):  # fmt: skip
        return ("method", *name, _plain(owner, depth + 1, True))
    if not isinstance(func, types.FunctionType):
        return ("callable", *name)
    cells = tuple(_cell(c, depth + 1) for c in func.__closure__ or ())
    defaults = _plain(func.__defaults__, depth + 1), _plain(func.__kwdefaults__, depth + 1)
    return ("function", *name, _code(func.__code__), defaults, cells)


def _code(code: types.CodeType) -> tuple:
    constants = tuple(
        _code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts
    )
    return (code.co_code, constants, code.co_names)


def _cell(cell, depth: int):
    try:
        return _plain(cell.cell_contents, depth, True)
    except ValueError:  # an empty cell (a name not yet bound)
        return _NONE
