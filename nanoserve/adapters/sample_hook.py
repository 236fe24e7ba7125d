"""Where nanoserve's decode loop enters HF's ``generate``: the model class's ``_sample``.

``generate`` prepares everything (generation config, logits processors, stopping criteria,
``num_return_sequences`` copies, the cache, the prefill inputs) and then calls
``getattr(type(self), "_sample")(self, ...)`` for greedy and multinomial sampling. It looks
the method up on the class, not on the instance, so a method bound on the model is never
called: the hook is a function on the model's class that runs ``decode_loop.sample`` for a
model patched by nanoserve and the class's own ``_sample`` for every other instance. It is
put on the class when a patched model first generates and taken off when the last patched
model of that class is unpatched.
"""

from __future__ import annotations

import functools
import threading
import weakref

from nanoserve.adapters.decode_loop import sample
from nanoserve.adapters.step import state_of

_LOCK = threading.Lock()
# class -> (what the class's own __dict__ held under "_sample" or _ABSENT, patched models)
_HOOKED: dict[type, tuple[object, weakref.WeakSet]] = {}
_ABSENT = object()


def hook(model) -> None:
    """Make ``type(model)._sample`` run nanoserve's loop for ``model`` (idempotent)."""
    cls = type(model)
    with _LOCK:
        entry = _HOOKED.get(cls)
        if entry is None:
            own = cls.__dict__.get("_sample", _ABSENT)
            entry = _HOOKED[cls] = (own, weakref.WeakSet())
            inherited = cls._sample  # a hooked base class's: the one it wraps
            cls._sample = _dispatcher(getattr(inherited, "nanoserve_original", inherited))
        entry[1].add(model)


def unhook(model) -> None:
    """``model`` is unpatched: the class gets its own ``_sample`` back once no patched model
    of the class is left."""
    cls = type(model)
    with _LOCK:
        entry = _HOOKED.get(cls)
        if entry is None:
            return
        entry[1].discard(model)
        if any(state_of(m) is not None for m in entry[1]):
            return
        own, _ = _HOOKED.pop(cls)
        if own is _ABSENT:
            del cls._sample
        else:
            cls._sample = own


def _dispatcher(original):
    @functools.wraps(original)  # generate reads the decoding method's signature
    def _sample(self, *args, **kwargs):
        if state_of(self) is None:
            return original(self, *args, **kwargs)
        return sample(self, original, *args, **kwargs)

    _sample.nanoserve_original = original
    return _sample
