"""Blocks an earlier call stored are never served once what computed them changed, however it
changed: values written without a new tensor version (a fused optimizer step, ``.data``), a
forward hook, an adapter switched, rotary frequencies that follow the call's length; and a
model in training mode with attention dropout is refused, not silently run without it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import warnings
import weakref

import numpy as np
import pytest
import torch
import transformers
from helpers import BACKENDS, cache_name, patched, sharpen
from test_families import padded_batch, tiny_model
from test_more_families import tiny_model as more_family_model
from test_new_families import tiny_model as new_family_model

import nanoserve
from nanoserve.adapters.decode_loop import _CACHE_FIELD as CACHE_FIELD
from nanoserve.adapters.graph_forward import memory_signature
from nanoserve.adapters.prefix_salt import begin_prefix_salt, structure_key, unnameable

OPTS = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, output_logits=True,
            return_dict_in_generate=True)  # fmt: skip


def sharp_model(**overrides):
    """A tiny Llama whose logits are far from flat (so stale K/V shows in the tokens too)."""
    return sharpen(tiny_model("llama", **overrides))


def generate(model, call):
    """(output, prefix hits of the call) on the patched ``model``; (output, None) unpatched."""
    with torch.no_grad():
        out = model.generate(**call, **OPTS)
    hits = nanoserve.cache_stats(model)["prefix_hits"] if is_patched(model) else None
    return out, hits


def is_patched(model) -> bool:
    try:
        nanoserve.decode_graph_stats(model)
    except (RuntimeError, ValueError):
        return False
    return True


def assert_same(out, stock):
    """Stock's tokens, and each step's logits within 1e-5 of that step's largest stock logit
    (paged attention sums in another order: a rotary scaled by 1.7 gave 1.3e-5 beside a
    largest logit above 1 on an AMD EPYC CPU; stale K/V move logits by 0.26 or more)."""
    assert torch.equal(out.sequences, stock.sequences)
    for ours, theirs in zip(out.logits, stock.logits, strict=True):
        bound = 1e-5 * max(theirs.abs().max().item(), 1.0)
        torch.testing.assert_close(ours, theirs, atol=bound, rtol=0.0)


def stored_and_found(model, call):
    """The patched ``model`` runs ``call`` twice: the second finds the blocks the first
    stored (one row's prefix hit). Returns the second output."""
    generate(model, call)
    out, hits = generate(model, call)
    assert hits == 1  # unchanged: found again
    return out


def check_change_invalidates(model, call, change, backend="auto"):
    """A call stores the prompt, a second finds it; after ``change`` (applied to the patched
    model and to an unpatched copy alike) the next call finds nothing and gives the copy's
    output. Returns the unpatched copy."""
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64, backend=backend)
    stored_and_found(model, call)
    change(model)
    change(reference)
    out, hits = generate(model, call)
    assert hits == 0
    assert_same(out, generate(reference, call)[0])
    return reference


def fused_adamw_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    batch = padded_batch([12], 12, seed=9)
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    model.eval()


@BACKENDS  # the salt reads values by the content hash kernel with "triton", float sums with "auto"
def test_values_changed_without_a_new_version_find_nothing(backend):
    """Fused optimizers and writes through ``.data`` leave every tensor's version as it was;
    the salt compares the values too. (Planted: the salt without the values' sums and norms
    served the stale prefix in each case.)"""
    call = padded_batch([13], 13, seed=3)
    for change in (
        fused_adamw_step,
        lambda m: m.model.layers[0].self_attn.k_proj.weight.data.mul_(1.3),
        lambda m: m.model.embed_tokens.weight.data[call["input_ids"][0, 0]].copy_(
            m.model.embed_tokens.weight.data[5]
        ),
    ):
        model = sharp_model()
        versions = [p._version for p in model.parameters()]
        check_change_invalidates(model, call, change, backend)
        nanoserve.unpatch_model(model)
        assert [p._version for p in model.parameters()] == versions  # none saw a new version


def swap_row_pairs(weight: torch.Tensor) -> None:
    """Rows 0<->1, 2<->3, ... through ``.data``: the same values, sum and norm."""
    order = torch.arange(weight.shape[0]).view(-1, 2).flip(1).reshape(-1)
    weight.data.copy_(weight.data[order].clone())


def swap_columns(m):
    weight = m.model.layers[0].self_attn.o_proj.weight.data
    weight[:, [0, 5]] = weight[:, [5, 0]].clone()


def shift_bytes(m):
    m.model.codes.data[0, 2] += 1
    m.model.codes.data[1, 3] -= 1


def swap_byte_rows(m):
    m.model.codes.data.copy_(m.model.codes.data[[1, 0, 3, 2]].clone())


def nudge(m):
    m.model.layers[1].mlp.down_proj.weight.data[3, 4] += 1e-4


@pytest.mark.parametrize(
    "change",
    [lambda m: swap_row_pairs(m.model.layers[0].self_attn.v_proj.weight), swap_columns,
     shift_bytes, swap_byte_rows, nudge],
    ids=["rows", "columns", "bytes", "byte-rows", "one-value"],
)  # fmt: skip
@BACKENDS
def test_values_reordered_without_a_new_version_find_nothing(change, backend):
    """Writes through ``.data`` that keep each tensor's sum and norm: rows swapped in pairs
    (v_proj), two columns swapped (o_proj: another layout of the heads), and in a one-byte
    buffer one value up and another down by one, or its rows swapped (sums exact in any
    order); and one value nudged by 1e-4 beside buffers of -inf, NaN and 1e30. Found by
    review: the sum and norm salt served the stale prefix (tokens differed from stock), and
    a -inf buffer hid every change from one total. Planted: unweighted row and column sums:
    every case here still passed, through rounding alone (the test below, which asks for
    more than rounding, failed); no squashing of the sums (NaN and infinities kept): every
    case failed."""
    call = padded_batch([13], 13, seed=3)
    model = sharp_model()
    # (buffers the forward does not read: only the salt can see them)
    model.model.register_buffer("codes", (torch.arange(16, dtype=torch.uint8) * 9).view(4, 4))
    model.model.register_buffer("masks", torch.tensor([float("-inf"), float("nan"), 1e30]))
    before = [m for t in model.state_dict().values() for m in moments(t)]
    check_change_invalidates(model, call, change, backend)
    if change is not nudge:
        after = [m for t in model.state_dict().values() for m in moments(t)]
        assert after == pytest.approx(before, nan_ok=True)  # what the old salt compared
    nanoserve.unpatch_model(model)


@BACKENDS
def test_a_weight_transposed_in_place_between_calls_finds_nothing(backend):
    """A square weight set through ``.data`` to its own transpose: the same address, shape,
    dtype and version, the same bytes in memory, other values at each place. The hash's
    layout kept from the last call must not be launched over it as before. Planted:
    contiguity left out of what the kept layout compares: the stale prefix was found."""

    def transpose(m):
        weight = m.model.layers[0].self_attn.q_proj.weight
        weight.data = weight.data.t()

    call = padded_batch([13], 13, seed=3)
    model = sharp_model()
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == model.config.hidden_size
    check_change_invalidates(model, call, transpose, backend)
    nanoserve.unpatch_model(model)


def test_a_reordering_moves_the_fingerprint_beyond_rounding():
    """Swapped rows, swapped columns, a reversed vector, integer or float: the fingerprint
    moves by far more than float rounding (which alone may or may not move a sum of
    reordered terms). Planted: unweighted sums: failed, a move of rounding size."""
    from nanoserve.adapters.prefix_salt import _fingerprint

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 5, generator=gen)
    codes = torch.randint(0, 255, (4, 4), generator=gen, dtype=torch.uint8)
    cases = [
        (weight, weight[[1, 0, 2, 3, 5, 4]]),
        (weight, weight[:, [0, 3, 2, 1, 4]]),
        (weight[0], weight[0].flip(0)),
        (codes, codes[[1, 0, 3, 2]]),
    ]
    for before, after in cases:
        ((first, second),) = _fingerprint([before])
        ((first_after, second_after),) = _fingerprint([after.contiguous()])
        assert abs(first_after - first) > 1e-6 * abs(first)
        assert abs(second_after - second) > 1e-6 * abs(second)


def moments(t: torch.Tensor) -> tuple[float, float]:
    """What the old salt compared: the sum and norm (one-byte tensors: the byte sum)."""
    norm = t.double().norm().item() if t.is_floating_point() else 0.0
    return t.double().sum().item(), norm


def test_a_forward_hook_added_or_removed_between_calls():
    """A hook that changes a layer's output is part of what names the blocks; once it is
    removed, the blocks stored before it are valid again."""
    model = sharp_model()
    call = padded_batch([13], 13, seed=3)
    handles = []

    def add_hook(m):
        proj = m.model.layers[0].self_attn.k_proj
        handles.append(proj.register_forward_hook(lambda module, args, out: out * 1.5))

    reference = check_change_invalidates(model, call, add_hook)
    for handle in handles:
        handle.remove()
    out, hits = generate(model, call)
    assert hits == 1
    assert_same(out, generate(reference, call)[0])
    nanoserve.unpatch_model(model)


class _Doubled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _subclassed_k_proj(m):
    """k_proj replaced by a Linear subclass holding the same weight Parameter."""
    old = m.model.layers[0].self_attn.k_proj
    new = _Doubled(old.in_features, old.out_features, bias=False, device="meta")
    new.weight = old.weight
    m.model.layers[0].self_attn.k_proj = new


def _every(kind: str, change):
    """Apply ``change`` to every module whose class name ends with ``kind``."""
    return lambda m: [change(x) for x in m.modules() if type(x).__name__.endswith(kind)]


def _triple_scaling(attention):
    attention.scaling *= 3  # the score scale, a plain float


def _large_eps(norm):
    norm.variance_epsilon = 0.5  # a plain float


NON_TENSOR_CHANGES = {
    "rotary attention_scaling": (
        "llama",
        lambda m: setattr(m.model.rotary_emb, "attention_scaling", 1.7),
    ),
    "attention scaling": ("llama", _every("Attention", _triple_scaling)),
    "rms_norm eps": ("llama", _every("RMSNorm", _large_eps)),
    "activation swapped": (
        "llama",
        lambda m: setattr(m.model.layers[0].mlp, "act_fn", torch.nn.GELU()),
    ),
    "k_proj subclassed, same weight": ("llama", _subclassed_k_proj),
    "config.sliding_window": ("mistral", lambda m: setattr(m.config, "sliding_window", 3)),
}


@pytest.mark.parametrize("change", list(NON_TENSOR_CHANGES))
def test_non_tensor_changes_between_calls_find_nothing(change):
    """What a forward reads besides tensors names the blocks too: plain attributes of any
    module, which modules (by class) make up the model, and the config. Planted, reverted: the
    salt over tensors, hooks and adapters alone: each case found the first call's blocks and
    its logits moved (by 0.26 to 6.4)."""
    family, apply = NON_TENSOR_CHANGES[change]
    model = sharpen(tiny_model(family))
    check_change_invalidates(model, padded_batch([13], 13, seed=3), apply)
    nanoserve.unpatch_model(model)


def _scaled_silu(scale: float):
    return lambda x: torch.nn.functional.silu(x) * scale


class _ScaledSilu:
    """A callable object (not a module) whose forward reads a plain attribute."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, x):
        return torch.nn.functional.silu(x) * self.scale


def _set_activation(model, activation) -> None:
    """The first layer's MLP activation as a plain attribute (not a submodule)."""
    mlp = model.model.layers[0].mlp
    if "act_fn" in mlp._modules:
        del mlp.act_fn
    mlp.act_fn = activation


_leaky = torch.nn.functional.leaky_relu
# two lambdas of one module and qualified name ("<lambda>"), other code
_LAMBDAS = (lambda x: torch.nn.functional.silu(x) * 0.2, lambda x: -torch.nn.functional.silu(x) * 4)
# (activation before, the change between calls) on the first layer's MLP
ACTIVATION_CHANGES = {
    "partial's argument": (
        functools.partial(_leaky, negative_slope=0.1),
        lambda m: _set_activation(m, functools.partial(_leaky, negative_slope=3.0)),
    ),
    "lambda for another": (_LAMBDAS[0], lambda m: _set_activation(m, _LAMBDAS[1])),
    "closure's value": (_scaled_silu(0.2), lambda m: _set_activation(m, _scaled_silu(-4.0))),
    "bound method's owner": (
        torch.nn.LeakyReLU(0.1).forward,
        lambda m: _set_activation(m, torch.nn.LeakyReLU(3.0).forward),
    ),
    "callable object's attribute": (
        _ScaledSilu(0.2),
        lambda m: setattr(m.model.layers[0].mlp.act_fn, "scale", -4.0),
    ),
}


@pytest.mark.parametrize("change", list(ACTIVATION_CHANGES))
def test_an_activation_held_as_a_function_changed_between_calls(change):
    """An activation held as a plain function is named by what it runs, not only by its
    name: a partial's arguments, a lambda's code, a closure's values, a bound method's
    owner, a callable object's attributes. Planted: callables named by module and qualified
    name (the salt before): every case found the first call's blocks and its tokens moved."""
    first, apply = ACTIVATION_CHANGES[change]
    model = sharp_model()
    _set_activation(model, first)
    check_change_invalidates(model, padded_batch([13], 13, seed=3), apply)
    nanoserve.unpatch_model(model)


_silu, _gelu = torch.nn.functional.silu, torch.nn.functional.gelu


def _scripted(factor: float):
    """A TorchScript function named ``scaled`` (the name alone does not tell two apart)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript is deprecated)
        source = f"def scaled(x: torch.Tensor) -> torch.Tensor:\n    return x * {factor}\n"
        return torch.jit.CompilationUnit(source).scaled


# callables a module may hold that carry no Python code of their own (a ufunc, an operator,
# a wrapper, TorchScript): one of each pair swapped for the other must change the key
OPAQUE_SWAPS = {
    "ufunc": (np.exp, np.log),
    "torch operator": (torch.ops.aten.add, torch.ops.aten.mul),
    "functools.wraps wrapper": (functools.lru_cache(_silu), functools.lru_cache(_gelu)),
    "builtin method's owner": (torch.ones(2).mul, torch.full((2,), 3.0).mul),
    "TorchScript function": (_scripted(2.0), _scripted(3.0)),
}


@pytest.mark.parametrize("swap", list(OPAQUE_SWAPS))
def test_a_callable_without_code_is_named_apart_from_another(swap):
    """Planted: callable objects named by class and public attributes alone, a wrapper's
    ``__wrapped__`` and a TorchScript function's code not read: the ufunc, the wrapper and
    the TorchScript function kept the key."""
    first, second = OPAQUE_SWAPS[swap]
    model = sharp_model()
    mlp = model.model.layers[0].mlp
    mlp.extra = first
    key = structure_key(model)
    assert structure_key(model) == key  # stable while nothing changes
    mlp.extra = second
    assert structure_key(model) != key


class _ScaledLinear(torch.nn.Linear):
    """A Linear whose output is scaled by a tensor held as a plain attribute (no buffer)."""

    def forward(self, x):
        return super().forward(x) * self.scale


@BACKENDS
def test_a_tensor_attribute_written_through_data_finds_nothing(backend):
    """A plain tensor attribute a forward reads has its values fingerprinted like a buffer:
    a write through ``.data`` keeps its address and version. Planted: such tensors named by
    address and version only (the salt before): the stale block was found and served."""
    model = sharp_model()
    old = model.model.layers[0].self_attn.k_proj
    scaled = _ScaledLinear(old.in_features, old.out_features, bias=False)
    scaled.weight = old.weight
    scaled.scale = torch.full((old.out_features,), 1.5)
    model.model.layers[0].self_attn.k_proj = scaled
    call = padded_batch([13], 13, seed=3)
    change = lambda m: m.model.layers[0].self_attn.k_proj.scale.data.fill_(-3.0)  # noqa: E731
    check_change_invalidates(model, call, change, backend)
    nanoserve.unpatch_model(model)


class _HeldProjection(torch.nn.Module):
    """k_proj's stand-in that adds a table nested two containers deep and a helper Linear
    kept in a plain list (neither registered: no module walk reaches them)."""

    def __init__(self, old: torch.nn.Linear):
        super().__init__()
        self.inner = old
        self.tables = {"shift": [torch.zeros(old.out_features)]}
        helper = torch.nn.Linear(old.in_features, old.out_features, bias=False)
        torch.nn.init.zeros_(helper.weight)
        self.helpers = [helper]
        self.owners = [self]  # (a module holding itself: read once)

    def forward(self, x):
        return self.inner(x) + self.tables["shift"][0] + self.helpers[0](x)


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.tables["shift"][0].data.fill_(2.0),
        lambda p: p.helpers[0].weight.data.normal_(generator=torch.Generator().manual_seed(1)),
        lambda p: torch.no_grad()(p.helpers[0].weight.add_)(0.5),
    ],
    ids=["nested-tensor-data", "held-module-data", "held-module-in-place"],
)
@BACKENDS
def test_tensors_held_in_containers_are_fingerprinted(change, backend):
    """A tensor two containers deep, and a module kept in a list attribute (its weight
    written through ``.data`` or in place): the next call finds nothing and gives stock's
    output. Found by a probe: the salt read tensors one container deep and no module held
    in a container (stale K/V served, logits off by 7). Planted: containers read one level
    and modules in them skipped (the salt before): each case found the stale block."""
    model = sharp_model()
    attention = model.model.layers[0].self_attn
    attention.k_proj = _HeldProjection(attention.k_proj)
    call = padded_batch([13], 13, seed=3)
    check_change_invalidates(
        model, call, lambda m: change(m.model.layers[0].self_attn.k_proj), backend
    )
    nanoserve.unpatch_model(model)


def test_a_module_held_in_a_container_is_read_once():
    """A list attribute holding the model's own modules (a back-reference) or one module
    twice adds nothing to the tensors the salt reads: those are the walk's, read once."""
    model = sharp_model()
    state = types.SimpleNamespace(backend="auto", digest_plans={})
    before = len(begin_prefix_salt(model, state).layout)
    model.model.layers[0].mlp.owners = [model, model.model.layers[1]]
    model.model.layers[1].mlp.owners = (model, {"again": [model]})
    assert len(begin_prefix_salt(model, state).layout) == before


@dataclasses.dataclass
class _Settings:
    scale: float


class _ReadingLinear(torch.nn.Linear):
    """A Linear scaled by a value its forward reads off a plain attribute ``source`` of any
    kind (numpy, a namespace, a dataclass, a list of tensors)."""

    def forward(self, x):
        source = self.source
        if isinstance(source, (np.ndarray, np.generic)):
            scale = float(np.asarray(source).sum())
        elif isinstance(source, list):
            scale = float(source[0].sum())
        else:
            scale = source.scale
        return super().forward(x) * scale


def _reading_k_proj(model, source) -> None:
    old = model.model.layers[0].self_attn.k_proj
    new = _ReadingLinear(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    new.source = source
    model.model.layers[0].self_attn.k_proj = new


def _source(m):
    return m.model.layers[0].self_attn.k_proj.source


def _set_source(m, value):
    m.model.layers[0].self_attn.k_proj.source = value


# (what k_proj's forward reads, the change between calls)
READ_VALUE_CHANGES = {
    "numpy array in place": (np.full(3, 0.5), lambda m: _source(m).__setitem__(0, -2.0)),
    "numpy scalar rebound": (np.float32(1.5), lambda m: _set_source(m, np.float32(-1.5))),
    "namespace mutated": (
        types.SimpleNamespace(scale=1.5),
        lambda m: setattr(_source(m), "scale", -1.5),
    ),
    "dataclass mutated": (_Settings(1.5), lambda m: setattr(_source(m), "scale", -1.5)),
    "tensor in a list through .data": (
        [torch.full((2,), 0.75)],
        lambda m: _source(m)[0].data.fill_(-0.75),
    ),
}


@pytest.mark.parametrize("change", list(READ_VALUE_CHANGES))
def test_values_a_forward_reads_off_attributes_changed_between_calls(change):
    """numpy values (by a digest of their bytes), namespaces and dataclasses (by their
    attributes) and tensors in a list or dict attribute (fingerprinted) name the blocks.
    Planted: numpy values, config-like objects and tensors in containers not read (the salt
    before): each case found the stale block."""
    first, apply = READ_VALUE_CHANGES[change]
    model = sharp_model()
    _reading_k_proj(model, first)
    check_change_invalidates(model, padded_batch([13], 13, seed=3), apply)
    nanoserve.unpatch_model(model)


def test_a_class_forward_patched_between_calls(monkeypatch):
    """A modeling class's forward replaced between calls (a kernel library patching the
    class) names other blocks: each class's forward is part of the structure key. Planted:
    the forwards left out: the stale block was found and served."""
    mlp_class = type(sharp_model().model.layers[0].mlp)
    stock_forward = mlp_class.forward

    def doubled(self, x):
        return 2 * stock_forward(self, x)

    model = sharp_model()
    change = lambda m: monkeypatch.setattr(mlp_class, "forward", doubled)  # noqa: E731
    check_change_invalidates(model, padded_batch([13], 13, seed=3), change)
    nanoserve.unpatch_model(model)


class _Odd(torch.nn.Module):
    """A submodule no forward calls, holding what a walk of the model must survive."""

    @property
    def attention_dropout(self):
        raise RuntimeError("not configured")

    def extra_repr(self):
        raise RuntimeError("no repr")


class _BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


class _Unlisted(list):
    """A list whose iteration raises."""

    def __iter__(self):
        raise TypeError("not iterable today")


def test_odd_things_a_model_holds_neither_crash_nor_miss():
    """A model holding things no forward reads (a property that raises, an extra_repr that
    raises, a dead weakref proxy, a dict key whose repr raises, a list whose iteration
    raises, sparse, quantized and nested tensors; then a scripted submodule) gives stock's
    tokens and finds its prefix again (but past the scripted module, whose forward counts
    as wrapped). Planted, one at a time: module_attr without its guard, _adapters_on
    printing the root's active_adapters method (the model's repr), _tensor_layout's data_ptr
    unguarded, _attributes without its guard (the dead proxy), the quantized tensor
    fingerprinted as it is, _tensors_held without its guard: each crashed (a RuntimeError,
    ReferenceError or TypeError, a segfault for the quantized tensor)."""
    model = sharp_model()
    reference = copy.deepcopy(model)
    odd = _Odd()
    referent = _Settings(1.0)
    odd.proxy = weakref.proxy(referent)
    del referent  # (the proxy is dead from here on)
    odd.table = {_BadRepr(): 1}
    odd.stubborn = _Unlisted([1, 2])
    odd.register_buffer("sparse", torch.eye(3).to_sparse())  # (the graphs' signature too)
    odd.quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    odd.nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    model.model.odd = odd
    call = padded_batch([13], 13, seed=3)
    with patched(model, block_size=4, num_blocks=64):
        out = stored_and_found(model, call)
        assert_same(out, generate(reference, call)[0])
        assert memory_signature(model, out.past_key_values) is not None  # (a GPU call's)
        # a scripted submodule's forward counts as wrapped: nothing is shared, nothing fails
        odd.scripted = torch.jit.script(torch.nn.Linear(2, 2))
        out, hits = generate(model, call)
        assert hits == 0
    assert_same(out, generate(reference, call)[0])


class _Adapter(torch.nn.Module):
    """A peft-style tuner layer: a low-rank delta on a projection, switched by attributes."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base = base
        self.delta = torch.nn.Linear(base.in_features, base.out_features, bias=False)
        torch.nn.init.normal_(self.delta.weight, std=0.5)
        self.disable_adapters = False
        self.active_adapters = ["default"]
        self.merged_adapters = []

    def forward(self, x):
        out = self.base(x)
        return out if self.disable_adapters else out + self.delta(x)


def test_an_adapter_switched_off_between_calls():
    model = sharp_model()
    attention = model.model.layers[0].self_attn
    attention.k_proj = _Adapter(attention.k_proj)
    call = padded_batch([13], 13, seed=3)

    def switch_off(m):
        m.model.layers[0].self_attn.k_proj.disable_adapters = True

    check_change_invalidates(model, call, switch_off)
    nanoserve.unpatch_model(model)


def new_entry(linear, weight):
    """A new tensor for ``linear``'s weight in its offload hook's map, as accelerate's
    ``offload_weight`` writes one (the map of a disk offload reads files otherwise)."""
    weights = linear._hf_hook.weights_map
    entries = getattr(weights.dataset, "state_dict", weights.dataset)
    entries[weights.prefix + "weight"] = weight


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offloaded_weights_changed_between_calls_find_nothing(offload, tmp_path):
    """accelerate's offload leaves the parameters on the meta device and copies each
    module's in from its hook's ``weights_map`` before the module's forward: unchanged, a
    later call finds the stored prompt (on disk each read is a new tensor); a value edited
    in the map (in place on the CPU copy, or a new entry) is never served stale. (Planted:
    without ``_offloaded_values`` the edited call found the stale prefix; with the values'
    addresses in the key the disk-offloaded one never found its own.)"""
    from accelerate import cpu_offload, disk_offload

    call = padded_batch([13], 13, seed=3)
    model = sharp_model()
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    if offload == "cpu":
        cpu_offload(model, execution_device="cpu")
    else:
        disk_offload(model, str(tmp_path), execution_device="cpu")
    k_proj, v_proj = (getattr(model.model.layers[0].self_attn, n) for n in ("k_proj", "v_proj"))
    assert k_proj.weight.device.type == "meta"
    assert_same(stored_and_found(model, call), generate(reference, call)[0])
    with torch.no_grad():
        reference.model.layers[0].self_attn.k_proj.weight.mul_(1.3)
        reference.model.layers[0].self_attn.v_proj.weight.mul_(-1.0)
        if offload == "cpu":
            k_proj._hf_hook.weights_map["weight"].mul_(1.3)
        else:
            new_entry(k_proj, reference.model.layers[0].self_attn.k_proj.weight.clone())
        new_entry(v_proj, reference.model.layers[0].self_attn.v_proj.weight.clone())
    out, hits = generate(model, call)
    assert hits == 0
    assert_same(out, generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_an_offloaded_edit_keeping_every_sum_finds_nothing():
    """An edit in place in accelerate's CPU offload map that keeps every row and column
    sum (the float fingerprint's blind spot, which a parameter's version covers): the
    map's tensor's version names it. Planted: without it the edited call found the stale
    prefix (logits off by 0.7)."""
    from accelerate import cpu_offload

    model = sharp_model()
    with torch.no_grad():
        weight = model.model.layers[0].self_attn.k_proj.weight
        weight.copy_((weight * 256).round() / 256)  # sums stay exact under the edit
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    cpu_offload(model, execution_device="cpu")
    call = padded_batch([13], 13, seed=3)
    stored_and_found(model, call)
    map_weight = model.model.layers[0].self_attn.k_proj._hf_hook.weights_map["weight"]
    with torch.no_grad():
        for w in (map_weight, reference.model.layers[0].self_attn.k_proj.weight):
            w[:2, :2] += torch.tensor([[0.125, -0.125], [-0.125, 0.125]])
    out, hits = generate(model, call)
    assert hits == 0
    assert_same(out, generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_a_model_loaded_with_layers_on_disk_finds_its_prompt_again(tmp_path):
    """``from_pretrained`` with a device map that puts a layer on disk: accelerate bumps
    the offloaded (meta) parameters' versions as it moves values in and out, which name
    nothing (their values are read from the map). Planted: with their versions in the key
    the second call found nothing (the third did)."""
    sharp_model().save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload",
        dtype=torch.float32,
    )  # fmt: skip
    reference = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "model", dtype=torch.float32
    )
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    call = padded_batch([13], 13, seed=3)
    assert_same(stored_and_found(model, call), generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_dynamic_rope_shares_no_prefix_across_calls():
    """Dynamic rotary scaling picks its frequencies from the call's length: a later call of
    another length computes other K for the same prefix. (Before: the fifth call below found
    blocks stored under the 40-token call's scaling, logits 0.35 off.)"""
    model = sharp_model(max_position_embeddings=32,
                        rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                         "rope_theta": 10000.0})  # fmt: skip
    assert "'dynamic'" in unnameable(model)
    assert unnameable(sharp_model()) is None
    reference = copy.deepcopy(model)
    prompt = torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(2))
    with patched(model, block_size=4, num_blocks=128):
        for length in (40, 20, 40, 20, 36):
            call = dict(input_ids=prompt[:, :length])
            out, hits = generate(model, call)
            assert hits == 0 and out[CACHE_FIELD].prefix_salt is None
            assert_same(out, generate(reference, call)[0])


def test_attention_dropout_in_training_mode_runs_stocks_generate():
    """Attention dropout in training mode (trl's GRPO generates so): the paged kernels
    apply none, so the call runs stock's generate, drawing stock's dropout; a caller's own
    forward over a PagedCache is refused. In eval mode the paged path again. Planted:
    ``drops_attention_out`` answering None, generate raised "dropout: ... training mode"."""
    model = sharp_model(attention_dropout=0.3)
    reference = copy.deepcopy(model).train()
    call = padded_batch([9, 6], 9, seed=3)
    model.train()
    assert "training mode" in unnameable(model)  # and no prefix is shared across calls
    with patched(model):
        for seed in (0, 1):
            torch.manual_seed(seed)
            with torch.no_grad():
                out = model.generate(**call, **OPTS)
            assert nanoserve.decode_graph_stats(model)["decode_loop"].startswith("stock")
            torch.manual_seed(seed)
            assert_same(out, generate(reference, call)[0])
        model.eval()
        reference.eval()
        out, _ = generate(model, call)
        assert nanoserve.decode_graph_stats(model)["decode_loop"] == "nanoserve"
        model.train()
        grown = torch.ones(2, OPTS["max_new_tokens"], dtype=torch.long)
        mask = torch.cat([call["attention_mask"], grown], 1)
        step = dict(input_ids=out.sequences[:, -1:], attention_mask=mask)
        with pytest.raises(ValueError, match="^dropout: .* training mode"), torch.no_grad():
            model(**step, **{cache_name(model): out[CACHE_FIELD]})
    assert_same(out, generate(reference, call)[0])


def _dropping_model(kind: str):
    """A model in training mode that drops out by ``kind``: Phi-3's dropout modules,
    Starcoder2's and Seed-OSS's rates read by ``F.dropout`` in their forwards, a
    ``Dropout1d`` (no subclass of ``nn.Dropout``) in an MLP, Mixtral's router input scaled
    by uniform noise."""
    if kind == "phi3 modules":
        return new_family_model("phi3", resid_pdrop=0.5).train()
    if kind == "dropout1d":
        model = new_family_model("phi3")
        model.model.layers[0].mlp.activation_fn = torch.nn.Sequential(
            model.model.layers[0].mlp.activation_fn, torch.nn.Dropout1d(0.5)
        )
        return model.train()
    family, rate = kind.split()  # (Seed-OSS's default attention dropout would be refused)
    return more_family_model(family, **{rate: 0.5, "attention_dropout": 0.0}).train()


@pytest.mark.parametrize(
    "kind",
    [
        "phi3 modules",
        "dropout1d",
        "starcoder2 residual_dropout",
        "starcoder2 embedding_dropout",
        "seed_oss residual_dropout",
        "mixtral router_jitter_noise",
    ],
)
def test_copies_of_a_prompt_draw_their_own_dropout_in_training_mode(kind):
    """A model in training mode that drops out (a dropout module, or a rate its forward
    passes to ``F.dropout``) computes each copy of a prompt differently, as stock does: no
    row takes another's prefill, so the copies' first logits differ. Planted: the first
    forward sharing copies regardless (cache.drops_out left None): failed, a row took the
    other's prefill; found by a probe and a review: Starcoder2's and Seed-OSS's rates, a
    ``Dropout1d`` and Mixtral's router jitter were not seen (the copies shared one
    prefill)."""
    model = _dropping_model(kind)
    prompt = padded_batch([9], 9, seed=3)["input_ids"].repeat(2, 1)
    with patched(model, block_size=4), torch.no_grad():
        torch.manual_seed(0)
        out = model.generate(prompt, **OPTS)
        assert nanoserve.cache_stats(model)["rows_shared"] == 0
    torch.manual_seed(0)
    with torch.no_grad():
        stock = model.generate(prompt, **OPTS)
    assert not torch.equal(stock.logits[0][0], stock.logits[0][1])  # stock's copies differ
    assert not torch.equal(out.logits[0][0], out.logits[0][1])
    model.eval()
    with patched(model, block_size=4), torch.no_grad():  # in eval mode the copies share again
        model.generate(prompt, **OPTS)
        assert nanoserve.cache_stats(model)["rows_shared"] == 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_dropout_in_training_mode_runs_hfs_loop_with_stocks_draws(do_sample):
    """Training mode with dropout: rows ending at different steps and seeded draws give
    stock's tokens and leave the random generator where stock leaves it, because HF's loop
    runs (nanoserve's loop drops finished rows from the forward, which shifts the dropout
    draws, and runs steps past a stop). Found by review: tokens differed after the first
    row finished. Planted: the decode loop's dropout reason removed: both cases failed."""
    model = new_family_model("phi3", resid_pdrop=0.1, embd_pdrop=0.1).train()
    reference = copy.deepcopy(model)
    call = padded_batch([1 + (i * 5) % 13 for i in range(5)], 13, seed=5)
    opts = dict(do_sample=do_sample, eos_token_id=list(range(10, 97, 4)), pad_token_id=1,
                max_new_tokens=12)  # fmt: skip
    torch.manual_seed(7)
    with torch.no_grad():
        stock = reference.generate(**call, **opts)
    after_stock = torch.rand(3)
    with patched(model, block_size=4), torch.no_grad():
        torch.manual_seed(7)
        out = model.generate(**call, **opts)
        after = torch.rand(3)
        loop = nanoserve.decode_graph_stats(model)["decode_loop"]
    assert (stock == 1).any()  # some row ended early (then padded)
    assert torch.equal(out, stock)
    assert torch.equal(after, after_stock)
    assert "drops out" in loop


@BACKENDS
def test_a_complex_buffer_is_fingerprinted(backend):
    """A complex buffer (rotary tables some models keep as complex numbers) is part of the
    salt, imaginary parts too: conjugating one entry makes the next call miss. Planted:
    complex tensors summed as they are (torch keeps the real parts, with a warning): the
    third call found the stale block."""
    model = sharp_model()
    model.model.register_buffer("table", torch.polar(torch.ones(8), torch.arange(8.0)))
    call = padded_batch([13], 13, seed=3)
    with patched(model, block_size=4, num_blocks=64, backend=backend):
        stored_and_found(model, call)
        with torch.no_grad():
            model.model.table.data[3] = model.model.table[3].conj()  # no new version
        assert generate(model, call)[1] == 0


def test_inference_tensors_in_the_model():
    """Tensors made under inference_mode keep no version; the salt compares their values."""
    with torch.inference_mode():
        model = sharp_model()
        reference = copy.deepcopy(model)
    call = padded_batch([13], 13, seed=3)
    with patched(model, block_size=4, num_blocks=64):
        out = stored_and_found(model, call)
    assert_same(out, generate(reference, call)[0])
