"""A step of a float16 / bfloat16 model in fewer, faster launches.

Under a CUDA graph a decode step of a small model is bound by its many small kernels: eager
RMSNorm is about seven of them, and cuBLAS reads a layer's small k and v projections at a
fraction of the bandwidth; in a prefill, eager's norms, rotary products and SiLU pass over
the activations again and again. Inside ``FusedDecode.active()`` (entered while the
CUDA-graph runner warms up and captures a decode or extend step, and around an eager step on
the GPU) every RMSNorm of the family's classes (``Family.rms_norm_classes``) runs as one
``rms_norm`` launch, and, in steps of up to 64 token rows, each decoder layer's q, k and v
projections run as one ``small_batch_linear`` launch (which also writes q and k rotated
where the rotation runs fused: ``qkv_rotary.py``) and a gated MLP of the form
``down(silu(gate(x)) * up(x))`` as two (gate and up with the activation and product, then
down; past 16 rows down runs on cuBLAS). Past 64 rows the MLP runs cuBLAS's three products
with the activation and product between them as one ``silu_mul`` launch (bit-equal to
eager's on CUDA).

q/k/v work with any attention module: the first of the three called computes all three and
leaves the others' outputs for them, matched by the identity of the input tensor; a module
called on another input (or a step of more rows than the kernel takes) computes its own with
``torch.nn.functional.linear``, as stock does. The MLP is replaced only for the classes the
family names (``Family.gated_mlp_classes``), whose forward is that formula, and only when
none of its projections carries a hook (the fused forward does not call them). The rotary
embedding of the family's attention classes (``Family.rotary_attention_classes``) runs as
one launch for q and k (``fused_rotary.py``), and the step's cos and sin tables, computed by
the model's rotary embedding module of the family's classes, as one more
(``rotary_tables.py``); neither under ``compile_decode``, whose compiler fuses them already.

Outputs accumulate in float32 and round where eager PyTorch rounds; the summation order
differs, so 16-bit results can differ from stock's in the last bit (the MLP's by a few units,
carried through silu and the product), as they differ between cuBLAS's own kernels for other
batch sizes. float32 models keep stock's modules (exact).
A module whose ``forward`` is already an instance attribute (another library's wrapper, as
accelerate's offload hooks) is left alone.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from nanoserve.adapters import fused_rotary
from nanoserve.adapters.fused_inputs import fusable, plain_linear, records_grad
from nanoserve.adapters.fused_inputs import version_counter as _version
from nanoserve.adapters.fused_residual import ResidualNorms
from nanoserve.adapters.modeling_classes import modeling_forward
from nanoserve.adapters.qkv_rotary import QKVRotary
from nanoserve.adapters.rotary_tables import rotary_table_forward, rotary_table_module
from nanoserve.kernels.dispatch import interpreted_bfloat16, use_triton
from nanoserve.kernels.fused_mlp import barrier_size, fused_mlp, new_barrier, one_launch_pays
from nanoserve.kernels.fused_mlp import input_problem as fused_mlp_problem
from nanoserve.kernels.gated_act import silu_mul
from nanoserve.kernels.rms_norm import input_problem as norm_problem
from nanoserve.kernels.rms_norm import rms_norm
from nanoserve.kernels.small_batch_linear import (
    MAX_ROWS,
    small_batch_linear,
    small_batch_linear_rotary,
)
from nanoserve.kernels.small_batch_linear import input_problem as linear_problem

FUSED_KINDS = (
    "attention", "mlp", "norm", "rotary", "residual", "rotary_table", "rotary_qkv", "kv_store",
)  # fmt: skip
# past this many rows cuBLAS reads a down projection's long K as fast as the kernel, whose
# programs each re-read the whole x tile
DOWN_MAX_ROWS = 16
# up to this many rows a bias-free MLP runs as one ``fused_mlp`` launch (0: never)
FUSED_MLP_MAX_ROWS = 16
_SILU_TYPES = ("SiLU", "SiLUActivation")  # torch.nn.SiLU, transformers' (both F.silu)


class _Siblings:
    """Linear layers reading one input: the first called computes all of them at once."""

    def __init__(
        self, linears: Sequence[torch.nn.Linear], backend: str, ran: set,
        rotary: QKVRotary | None = None, attention: torch.nn.Module | None = None,
    ):  # fmt: skip
        self.linears = list(linears)
        self.backend = backend
        self.ran = ran
        # q, k and v of ``attention``: q and k rotated ahead with ``rotary``'s tables
        self.rotary, self.attention = rotary, attention
        # sibling index -> (the input, its version counter then, the sibling's output)
        self.pending: dict[int, tuple[torch.Tensor, int | None, torch.Tensor]] = {}

    def forward_of(self, index: int):
        linear = self.linears[index]

        def forward(x: torch.Tensor) -> torch.Tensor:
            held = self.pending.pop(index, None)
            # (the very input, unchanged since: code between the calls may write it in place)
            if held is not None and held[0] is x and held[1] == _version(x):
                return held[2]
            flat = x.reshape(-1, x.shape[-1])
            # (a sibling's pre-hook could change its input after this one computed it)
            if _hooks_before(self.linears) or not fits(flat, self.linears, self.backend):
                self.pending = {}
                return F.linear(x, linear.weight, linear.bias)
            weights = [m.weight for m in self.linears]
            biases = [m.bias for m in self.linears] if linear.bias is not None else None
            tables = None
            if self.rotary is not None and self._rotates_ahead():
                tables = self.rotary.tables_for(x, flat, weights)
            # (weights_ready: no kernel of a decode step writes a parameter)
            if tables is not None:
                # The launch may store k and v at the step's slots before the cache's write
                # checks them: slots of this step alone, which its write (or a failed step's
                # abort) rewrites or drops. check=False: the cache built them, and the step
                # may be a graph's capture.
                store = self.rotary.store_target(self.attention, x, weights)
                out, *rotated = small_batch_linear_rotary(
                    flat, weights, biases, *tables, backend=self.backend, weights_ready=True,
                    kv_store=store, check=False,
                )  # fmt: skip
            else:
                out = small_batch_linear(
                    flat, weights, biases, backend=self.backend, weights_ready=True
                )
            sizes = [w.shape[0] for w in weights]
            outs = [y.view(*x.shape[:-1], y.shape[-1]) for y in out.split(sizes, dim=-1)]
            if tables is not None:
                layer = getattr(self.attention, "layer_idx", None)
                self.rotary.keep(outs[0], outs[1], *rotated, out, v=outs[2], store=store,
                                 layer=layer)  # fmt: skip
            self.pending = {i: (x, _version(x), y) for i, y in enumerate(outs) if i != index}
            self.ran.add(("attention", id(self)))
            return outs[index]

        return forward

    def _rotates_ahead(self) -> bool:
        """The rotation may be computed with the projections: the attention module runs
        transformers' own forward, not one set on it or its class (nothing between the
        projections and the rotation writes q or k), and no hook could change the
        projections' outputs (inference tensors keep no version counter, and a ``.data``
        write moves none). Not for a module that normalizes q or k before the rotation
        (Qwen3's ``q_norm`` / ``k_norm``): the rotation of the raw projections would never
        be taken."""
        return (
            self.attention is not None
            and "forward" not in self.attention.__dict__
            and modeling_forward(self.attention)
            and not _hooks_skipped(self.linears)
            and getattr(self.attention, "q_norm", None) is None
            and getattr(self.attention, "k_norm", None) is None
        )


def _gated_mlp_forward(mlp, classes: Sequence[str], backend: str, ran: set, note=None):
    barriers: dict[torch.device, torch.Tensor] = {}  # the one-launch MLP's grid barrier

    def barrier(device: torch.device, out_width: int) -> torch.Tensor | None:
        """This MLP's barrier state on ``device``, made outside a capture (one made while
        capturing would be zeroed only at replay: the launch then makes its graph its own)."""
        held = barriers.get(device)
        if (held is None or held.numel() < barrier_size(out_width)) and device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return None
            barriers[device] = new_barrier(device, out_width)
        return barriers.get(device)

    def stock_forward(x: torch.Tensor) -> torch.Tensor:
        return type(mlp).forward(mlp, x)  # (the class's forward now, as stock would call it)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _gated_mlp(mlp, classes):
            return stock_forward(x)
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        flat = x.reshape(-1, x.shape[-1])
        if not fits(flat, (gate, up), backend, gated=True):
            if not _activation_fits(x, (gate, up), backend):
                return stock_forward(x)
            # stock's three cuBLAS products; the SiLU and the product between them in one launch
            gated = F.linear(x, gate.weight, gate.bias)
            hidden = silu_mul(gated, F.linear(x, up.weight, up.bias), backend=backend)
            out = F.linear(hidden, down.weight, down.bias)
            ran.add(("mlp", id(mlp)))
            if note is not None:
                note(mlp, out)
            return out
        if one_launch_fits(flat, (gate, up, down)):
            state = barrier(flat.device, down.out_features)
            out = fused_mlp(flat, gate.weight, up.weight, down.weight, backend=backend,
                            barrier=state, weights_ready=True)  # fmt: skip
            ran.add(("mlp", id(mlp)))
            out = out.view(*x.shape[:-1], out.shape[-1])
            if note is not None:
                note(mlp, out)
            return out
        biases = [gate.bias, up.bias] if gate.bias is not None else None
        hidden = small_batch_linear(
            flat, [gate.weight, up.weight], biases, gated=True, backend=backend, weights_ready=True
        )
        if hidden.shape[0] > DOWN_MAX_ROWS:
            out = F.linear(hidden, down.weight, down.bias)
        elif not fits(hidden, (down,), backend):
            return stock_forward(x)  # (a down projection the kernel does not take)
        else:
            down_bias = [down.bias] if down.bias is not None else None
            out = small_batch_linear(
                hidden, [down.weight], down_bias, backend=backend, weights_ready=True
            )
        ran.add(("mlp", id(mlp)))
        out = out.view(*x.shape[:-1], out.shape[-1])
        if note is not None:
            note(mlp, out)
        return out

    return forward


def fits(
    x: torch.Tensor, linears: Sequence[torch.nn.Linear], backend: str, gated: bool = False
) -> bool:
    """True when the kernel takes ``x`` [M, K] through ``linears`` (``small_batch_linear``'s
    own conditions: at most 64 rows, weights and biases of x's dtype, device and width, ...)
    in a 16-bit step outside autocast (not bfloat16 in Triton's CPU interpreter, whose dot
    gets it wrong); anything else runs stock's."""
    weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    return (
        fusable(x)
        and not records_grad(x, *weights, *(b for b in biases if b is not None))
        and linear_problem(x, weights, biases, gated) is None
        and use_triton(backend, x)
        and not interpreted_bfloat16(x)
    )


def one_launch_fits(x: torch.Tensor, linears: Sequence[torch.nn.Linear]) -> bool:
    """True when the gated MLP of ``x`` [M, K] through ``linears`` (gate, up, down; the
    kernels' conditions for gate and up already met) runs as one ``fused_mlp`` launch: up
    to ``FUSED_MLP_MAX_ROWS`` rows, no bias, no gradient to record for down, and on a GPU
    weights of the sizes where it pays (``one_launch_pays``; the CPU's interpreted form
    serves the tests)."""
    gate, up, down = linears
    return (
        x.shape[0] <= FUSED_MLP_MAX_ROWS
        and all(m.bias is None for m in linears)
        and not records_grad(x, down.weight)
        and fused_mlp_problem(x, gate.weight, up.weight, down.weight) is None
        and (
            x.device.type != "cuda"
            or one_launch_pays(
                x.shape[1], gate.out_features, down.out_features, x.dtype, x.device
            )  # fmt: skip
        )
    )


def _activation_fits(x: torch.Tensor, linears: Sequence[torch.nn.Linear], backend: str) -> bool:
    """True when ``silu_mul`` takes the products of ``x`` through ``linears`` (the gate and
    up projections: weights and biases of x's dtype and device) in a 16-bit step outside
    autocast and autograd; anything else runs stock's."""
    tensors = [m.weight for m in linears] + [m.bias for m in linears if m.bias is not None]
    return (
        fusable(x)
        and all(t.dtype == x.dtype and t.device == x.device for t in tensors)
        and not records_grad(x, *tensors)
        and use_triton(backend, x)
    )


def _hooks_before(modules) -> bool:
    """A forward pre-hook (the module's own or a global one) may change a module's input."""
    global_hooks = getattr(torch.nn.modules.module, "_global_forward_pre_hooks", None)
    return bool(global_hooks) or any(m._forward_pre_hooks for m in modules)


def _hooks_skipped(modules) -> bool:
    """Hooks a fused forward that never calls ``modules`` would skip (theirs or global)."""
    global_hooks = getattr(torch.nn.modules.module, "_global_forward_hooks", None)
    return _hooks_before(modules) or bool(global_hooks) or any(m._forward_hooks for m in modules)


def _norm_forward(norm, backend: str, ran: set, residual=None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not modeling_forward(norm):  # a forward set on the class since: its own math
            return type(norm).forward(norm, x)
        held = residual.take(norm, x) if residual is not None else None
        if held is not None:  # computed with the residual add that made x
            ran.add(("norm", id(norm)))
            return held
        weight, eps = norm.weight, norm.variance_epsilon
        if (
            not fusable(x)
            or records_grad(x, weight)
            or norm_problem(x, weight, eps) is not None
            or not use_triton(backend, x)
        ):
            return type(norm).forward(norm, x)
        ran.add(("norm", id(norm)))
        return rms_norm(x, weight, eps, backend=backend)

    return forward


def _rms_norm(module, classes: Sequence[str]) -> bool:
    """One of the family's norm classes, not wrapped; its weight and eps are checked at
    every call (``norm_problem``)."""
    return (
        type(module).__name__ in classes
        and "forward" not in module.__dict__
        and modeling_forward(module)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )


def _attention_siblings(attention) -> tuple[torch.nn.Linear, ...] | None:
    names = ("q_proj", "k_proj", "v_proj")
    linears = tuple(getattr(attention, n, None) for n in names)
    if not all(plain_linear(m) for m in linears):
        return None
    if len({m.in_features for m in linears}) != 1:
        return None
    return linears


def _gated_mlp(mlp, classes: Sequence[str]) -> bool:
    """``mlp`` computes ``down(silu(gate(x)) * up(x))`` with plain modules the fused forward
    may skip: checked at every call, since modules and hooks can change between calls."""
    if type(mlp).__name__ not in classes or not modeling_forward(mlp):
        return False
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(plain_linear(m) for m in parts):
        return False
    gate, up, down = parts
    act = getattr(mlp, "act_fn", None)
    if type(act).__name__ not in _SILU_TYPES or "forward" in act.__dict__:
        return False
    if _hooks_skipped((*parts, act)):
        return False  # the fused forward calls none of them: their hooks would not run
    return gate.weight.shape == up.weight.shape and down.in_features == gate.out_features


class FusedDecode:
    """The fused forwards of a model's norms and its ``layers``' projections, swapped in only
    inside ``active()``. ``root``: the module whose submodules include every norm (the base
    model); ``family``: the model's ``Family`` (its MLP, RMSNorm and attention classes);
    ``rotary``: whether the rotary embedding is fused too; ``residual``: whether the residual
    adds of the family's pre-norm layers run with the norms after them
    (``fused_residual.py``)."""

    def __init__(
        self,
        root: torch.nn.Module,
        layers: Sequence[torch.nn.Module],
        family,
        backend: str,
        rotary: bool = True,
        residual: bool = True,
        compiled: bool = False,
    ):
        self.backend = backend
        self.compiled = compiled
        # (module, its fused forward, "norm" | "attention" | "mlp" | "table"): q/k/v groups
        # only serve steps of up to MAX_ROWS rows, and so does the MLP under compile_decode,
        # whose compiled layers call them uncompiled
        self.swaps: list[tuple[torch.nn.Module, object, str]] = []
        self.siblings: list[_Siblings] = []
        # ("attention" | "mlp" | "norm", id of the module) for each that has run fused, and
        # ("rotary" | "residual" | "rotary_table" | "rotary_qkv" | "kv_store", n) for the n-th
        # rotary call, fused add, cos and sin tables, rotation done by the q/k/v launch or K/V
        # rows it stored, of a step
        self.ran: set[tuple[str, int]] = set()
        attentions = [getattr(layer, "self_attn", None) for layer in layers]
        self.rotary_attentions = [a for a in attentions if a is not None] if rotary else []
        self.rotary_classes = family.rotary_attention_classes
        taken: set[int] = set()  # a module two layers share is swapped once, by the first

        def swap(modules, forwards, kind: str) -> None:
            taken.update(id(m) for m in modules)
            for m, f in zip(modules, forwards, strict=True):
                self.swaps.append((m, torch.compiler.disable(f), kind))

        norms = [m for m in root.modules() if _rms_norm(m, family.rms_norm_classes)]
        self.residual = None
        if residual and family.pre_norm_layer_classes:
            self.residual = ResidualNorms(
                layers,
                getattr(root, "norm", None),
                family.pre_norm_layer_classes,
                {id(m) for m in norms},
                backend,
                self.ran,
            )
        for module in norms:
            forward = _norm_forward(module, backend, self.ran, self.residual)
            swap([module], [forward], "norm")
        self.table_calls = itertools.count()
        self.qkv_rotary = QKVRotary()
        tables = family.rotary_embedding_classes if rotary else ()
        for module in root.modules():
            if rotary_table_module(module, tables):
                forward = rotary_table_forward(
                    module, backend, self._table_fused, self.qkv_rotary.note_tables
                )
                swap([module], [forward], "table")
        note = self.residual.note if self.residual is not None else None
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            linears = _attention_siblings(attention) if attention is not None else None
            if linears is not None and not taken & {id(m) for m in linears}:
                # (an attention module whose rotary embedding may run fused)
                group = _Siblings(
                    linears, backend, self.ran, self.qkv_rotary if rotary else None, attention
                )
                self.siblings.append(group)
                swap(linears, [group.forward_of(i) for i in range(len(linears))], "attention")
            mlp = getattr(layer, "mlp", None)
            classes = family.gated_mlp_classes
            if (
                mlp is not None
                and id(mlp) not in taken
                and _gated_mlp(mlp, classes)
                and "forward" not in mlp.__dict__
            ):
                fused = _gated_mlp_forward(mlp, classes, backend, self.ran, note)
                swap([mlp], [fused], "mlp")

    def _table_fused(self) -> None:
        self.ran.add(("rotary_table", next(self.table_calls)))

    @property
    def rotary_modules(self) -> tuple:
        """The modeling modules whose rotary embedding runs fused, looked up at each call
        (``kernels.kernelize`` may have run since the last)."""
        return fused_rotary.rotary_modules(self.rotary_attentions, self.rotary_classes)

    def counts(self) -> dict[str, int]:
        """Modules that have run fused in some step so far: {"attention": q/k/v groups,
        "mlp": gated MLPs, "norm": RMSNorms, "rotary": rotary calls, "residual": residual
        adds run with their norm, "rotary_table": cos and sin tables, "rotary_qkv": rotary
        calls the q/k/v launch had computed and "kv_store": layers whose K/V rows that launch
        stored in the pools (no scatter), the last five of the step that ran the most}
        (a step the kernels do not take runs stock's)."""
        kinds = [kind for kind, _ in self.ran]
        return {kind: kinds.count(kind) for kind in FUSED_KINDS}

    @contextlib.contextmanager
    def active(self, rows: int, residual: bool = True) -> Iterator[None]:
        """The fused forwards in place for a step of ``rows`` token rows (q/k/v groups only
        up to MAX_ROWS, which their kernel takes; the MLP past it too, by cuBLAS's products and
        ``silu_mul``, except under compile_decode, where it would only add graph breaks).
        ``residual=False`` leaves the residual adds to stock (their watch is a
        ``TorchFunctionMode`` that every op of the step goes through: cheap for a capture,
        a host cost at each eager step)."""

        def serves(kind: str) -> bool:
            if kind == "attention":
                return rows <= MAX_ROWS
            return kind in ("norm", "table") or rows <= MAX_ROWS or not self.compiled

        # a module whose forward another library wrapped since keeps that wrapper
        swapped = [
            (m, f) for m, f, kind in self.swaps if "forward" not in m.__dict__ and serves(kind)
        ]
        calls = itertools.count()
        self.table_calls = itertools.count()

        def rotary_fused() -> None:
            self.ran.add(("rotary", next(calls)))

        ahead = itertools.count()

        def rotated_ahead(q, k, cos, sin):
            held = self.qkv_rotary.take(q, k, cos, sin)
            if held is not None:
                self.ran.add(("rotary_qkv", next(ahead)))
            return held

        stores = itertools.count()

        def kv_stored() -> None:
            self.ran.add(("kv_store", next(stores)))

        rotary = contextlib.nullcontext()
        modules = self.rotary_modules
        self.qkv_rotary.reset(enabled=bool(modules), on_stored=kv_stored)
        if modules:
            rotary = fused_rotary.swapped(modules, self.backend, rotary_fused, rotated_ahead)
        residual = self.residual.active() if self.residual is not None and residual else None
        for module, forward in swapped:
            module.forward = forward
        try:
            with rotary, residual or contextlib.nullcontext():
                yield
        finally:
            self.qkv_rotary.reset()
            for group in self.siblings:
                group.pending = {}
            for module, forward in swapped:
                if module.__dict__.get("forward") is forward:
                    del module.forward
