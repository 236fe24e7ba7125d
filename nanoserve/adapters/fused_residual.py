"""A pre-norm decoder layer's residual adds and the RMSNorms after them, one launch each, in
captured decode and extend steps (not in eager ones: see ``FusedDecode.active``).

A layer of the family's ``pre_norm_layer_classes`` computes ``h = x + o_proj(...)`` and
then ``post_attention_layernorm(h)``, and ``h + mlp(...)`` followed by the next layer's
``input_layernorm`` (the last layer's: the model's final ``norm``). Eagerly each add is a
launch of its own. While a step is warmed up and captured (``FusedDecode.active``),
the sublayers' outputs are noted with the norm that follows them (o_proj's, by a stand-in
forward that runs stock's ``F.linear``; the fused MLP's), and a ``TorchFunctionMode`` sees
each add: one of a noted output and a tensor of its shape and dtype runs ``add_rms_norm``
instead, returns the sum and keeps the norm for that norm module, whose fused forward
returns it when called on that very sum tensor. Any other add, and a norm called on
anything else, run as before. The sum has the add's bits and the norm the bits the norm's
own kernel gives that sum: the step computes exactly what it computed unfused.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nanoserve.adapters.fused_inputs import fusable, plain_linear, records_grad
from nanoserve.kernels.dispatch import use_triton
from nanoserve.kernels.rms_norm import add_input_problem, add_rms_norm

_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}


class ResidualNorms:
    """The fused residual adds of ``layers`` (the family's pre-norm layer classes only),
    whose norms are in ``fused_norms`` (the norms swapped for the rms_norm kernel);
    ``final_norm``: the norm after the last layer. ``ran`` counts ("residual", n): the n-th
    norm of a step that took what an add computed for it."""

    def __init__(
        self,
        layers: Sequence[torch.nn.Module],
        final_norm: torch.nn.Module | None,
        layer_classes: Sequence[str],
        fused_norms: set[int],
        backend: str,
        ran: set,
    ):
        self.backend, self.ran = backend, ran
        self.norm_after: dict[int, torch.nn.Module] = {}  # id(o_proj or mlp) -> next norm
        o_projs: dict[int, torch.nn.Module] = {}
        shared: set[int] = set()  # a sublayer two layers share is followed by two norms
        for i, layer in enumerate(layers):
            if type(layer).__name__ not in layer_classes or "forward" in layer.__dict__:
                continue
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            o_proj = getattr(attention, "o_proj", None)
            if o_proj is not None:
                o_projs[id(o_proj)] = o_proj
            last = i + 1 == len(layers)
            after_mlp = final_norm if last else getattr(layers[i + 1], "input_layernorm", None)
            pairs = ((o_proj, getattr(layer, "post_attention_layernorm", None)), (mlp, after_mlp))
            for sublayer, norm in pairs:
                if sublayer is None or norm is None or id(norm) not in fused_norms:
                    continue
                if id(sublayer) in self.norm_after or id(sublayer) in shared:
                    shared.add(id(sublayer))
                    self.norm_after.pop(id(sublayer), None)
                else:
                    self.norm_after[id(sublayer)] = norm
        self.o_projs = [m for i, m in o_projs.items() if i in self.norm_after and plain_linear(m)]
        self.noted: dict[int, tuple[torch.Tensor, torch.nn.Module]] = {}
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(norm) -> (sum, norm)
        self.adds = itertools.count()
        self.watching = False  # inside active(): outside it nothing is noted (nor held)

    def o_proj_forward(self, o_proj: torch.nn.Module):
        """Stock's forward of a plain Linear, its output noted."""

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, o_proj.weight, o_proj.bias)
            self.note(o_proj, out)
            return out

        return forward

    def note(self, sublayer: torch.nn.Module, output: torch.Tensor) -> None:
        """``output`` of ``sublayer``: an add of it is fused with the norm that follows."""
        norm = self.norm_after.get(id(sublayer)) if self.watching else None
        if norm is not None:
            self.noted[id(output)] = (output, norm)

    def take(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The norm of ``x`` computed with the add that made it, or None."""
        held = self.held.pop(id(norm), None)
        if held is None or held[0] is not x:
            return None
        self.ran.add(("residual", next(self.adds)))
        return held[1]

    def fuse(self, a, b) -> torch.Tensor | None:
        """``a + b`` with the next norm kept, where one of them is a noted output; else None."""
        for output, other in ((b, a), (a, b)):
            entry = self.noted.get(id(output)) if isinstance(output, torch.Tensor) else None
            if entry is None or entry[0] is not output or not isinstance(other, torch.Tensor):
                continue
            norm = entry[1]
            weight, eps = norm.weight, getattr(norm, "variance_epsilon", None)
            if (
                not fusable(output)
                or add_input_problem(output, other, weight, eps) is not None
                or not use_triton(self.backend, output)
                or records_grad(output, other)
            ):
                return None
            del self.noted[id(output)]
            total, normed = add_rms_norm(output, other, weight, eps, backend=self.backend)
            self.held[id(norm)] = (total, normed)
            return total
        return None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The adds watched, and the o_proj stand-ins in place, for one step."""
        self.adds = itertools.count()
        swapped = [(m, self.o_proj_forward(m)) for m in self.o_projs if "forward" not in m.__dict__]
        for module, forward in swapped:
            module.forward = forward
        try:
            self.watching = True
            with _AddWatch(self):
                yield
        finally:
            self.watching = False
            self.noted, self.held = {}, {}
            for module, forward in swapped:
                if module.__dict__.get("forward") is forward:
                    del module.forward


class _AddWatch(TorchFunctionMode):
    def __init__(self, owner: ResidualNorms):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ADDS and not kwargs and len(args) == 2:
            total = self.owner.fuse(*args)
            if total is not None:
                return total
        return func(*args, **(kwargs or {}))
