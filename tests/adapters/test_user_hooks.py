"""Forward hooks that stock runs at every forward on the whole batch: a patched model keeps
stock's tokens with them. A hook on a submodule may compute each row, or each call,
differently (no prefix is shared: neither copies within the call nor blocks an earlier call
stored); any hook would see the batch shrink in nanoserve's decode loop (HF's loop runs).
accelerate's device hooks change no value and keep sharing on."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from test_decode_loop import EOS, eos_early
from test_families import padded_batch, tiny_model
from test_prefix_invalidation import assert_same, generate, sharp_model, stored_and_found

import nanoserve
from nanoserve.adapters.user_hooks import scan_hooks


class ScaleKeys:
    """A hook on k_proj whose effect the caller changes between calls (its handle stays)."""

    def __init__(self):
        self.factor = 1.0

    def __call__(self, module, args, out):
        return out * self.factor


def scale_by_row(module, args, out):
    """A hook that computes each row of the batch differently (steering by batch index)."""
    factor = 1.0 + 0.5 * torch.arange(out.shape[0], dtype=out.dtype)
    return out * factor.view(-1, *[1] * (out.dim() - 1))


def patched_pair(model):
    """(the model patched, an unpatched copy of it)."""
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    return model, reference


def check_found_across_calls(model):
    """Patched, a second call finds the prompt the first stored and gives stock's output."""
    model, reference = patched_pair(model)
    call = padded_batch([13], 13, seed=3)
    assert_same(stored_and_found(model, call), generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_a_hook_whose_state_changes_between_calls_finds_no_stored_prefix():
    """The first call stores the prompt's blocks with the hook scaling K by 1; the hook
    then scales by 1.7 under the same handle. Planted: prefix lookups with such a hook on
    (the salt sees only the handle): the second call found the stale blocks and its logits
    moved by about 6."""
    model, reference = patched_pair(sharp_model())
    hooks = [ScaleKeys(), ScaleKeys()]
    for m, h in zip((model, reference), hooks, strict=True):
        m.model.layers[0].self_attn.k_proj.register_forward_hook(h)
    call = padded_batch([13], 13, seed=3)
    generate(model, call)
    for h in hooks:
        h.factor = 1.7
    out, hits = generate(model, call)
    assert hits == 0
    assert_same(out, generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_a_hook_that_computes_rows_apart_shares_no_copy():
    """Two copies of one prompt, a hook scaling each row's K by its batch index: no row may
    take the other's prefill. Planted: copies shared with the hook on: row 1 took row 0's
    K/V and its logits moved by about 6."""
    model, reference = patched_pair(sharp_model())
    for m in (model, reference):
        m.model.layers[1].self_attn.k_proj.register_forward_hook(scale_by_row)
    one = padded_batch([13], 13, seed=3)
    call = {k: v.repeat(2, 1) for k, v in one.items()}
    out, _ = generate(model, call)
    assert nanoserve.cache_stats(model)["rows_shared"] == 0
    assert_same(out, generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_a_hook_on_the_model_sees_every_row_as_in_stock():
    """A hook on the model records each step's batch: rows ending at different steps must
    not leave it (HF's loop runs, and says why). Planted: nanoserve's loop with such a hook:
    the hook saw 3, 2 and 1 rows where stock shows 3."""
    model = eos_early(tiny_model("llama", seed=10), 3.0)  # rows end after 6, 13 and 4 tokens
    inputs = padded_batch([13, 6, 2], 13)
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.logits.shape[0]))
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=30)
        stock_seen, seen[:] = list(seen), []
        nanoserve.patch_model(model)
        ours = model.generate(**inputs, max_new_tokens=30)
    assert torch.equal(stock, ours)
    assert seen == stock_seen and set(seen) == {3}
    loop = nanoserve.decode_graph_stats(model)["decode_loop"]
    assert loop.startswith("stock: a forward hook on the model"), loop
    assert (stock[:, 13:] == EOS).any(dim=1).all()
    nanoserve.unpatch_model(model)


def test_device_hooks_keep_prefix_sharing():
    """accelerate's device hook (a wrapped forward that moves tensors) changes no value: a
    later call still finds the prompt (a graph replay would skip it, so ``replay`` names it)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = sharp_model()
    add_hook_to_module(model.model.layers[0], AlignDevicesHook(execution_device="cpu"))
    scan = scan_hooks(model)
    assert scan.rows is None and scan.batch is None
    assert scan.replay == "a wrapped forward on model.layers.0"
    check_found_across_calls(model)


def test_a_users_forward_under_accelerates_hook_shares_nothing():
    """A forward the user set on a module (its output scaled by state the user changes)
    that accelerate then wrapped (``add_hook_to_module`` keeps it as ``_old_forward``): not
    accelerate's neutral wrapper. Planted: ``_neutral`` not reading ``_old_forward`` served
    the blocks stored at scale 1 to the call at scale 3 (logits off by about 5)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = sharp_model()
    reference = copy.deepcopy(model)
    scales = [{"by": 1.0}, {"by": 1.0}]
    for m, scale in zip((model, reference), scales, strict=True):
        k_proj = m.model.layers[0].self_attn.k_proj
        k_proj.forward = lambda x, f=k_proj.forward, s=scale: f(x) * s["by"]
        add_hook_to_module(k_proj, AlignDevicesHook(execution_device="cpu"))
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    assert scan_hooks(model).rows == "a wrapped forward on model.layers.0.self_attn.k_proj"
    call = padded_batch([13], 13, seed=3)
    generate(model, call)
    for scale in scales:
        scale["by"] = 3.0
    out, hits = generate(model, call)
    assert hits == 0
    assert_same(out, generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_modules_unhooked_by_accelerate_keep_prefix_sharing():
    """``remove_hook_from_module`` leaves every module's own class forward bound in its
    ``__dict__``: no wrapper, sharing on. Planted: counted as "a wrapped forward" (no
    later call found its prompt)."""
    from accelerate.big_modeling import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    model = sharp_model()
    cpu_offload(model, execution_device="cpu")
    remove_hook_from_module(model, recurse=True)
    assert "forward" in model.model.embed_tokens.__dict__
    assert scan_hooks(model) == (None, None, None)
    check_found_across_calls(model)


def test_hooks_removed_after_patching_refuse_then_patch_again():
    """Offloaded, patched, then ``remove_hook_from_module``: accelerate puts back the class
    forward it found (or a partial of it, set by hand), and the patched generate would hand
    the paged cache to it. It refuses naming ``model.forward``, before anything changed;
    patched again it gives stock's tokens. Planted: without ``_check_forward`` (or without
    the partial in ``own_forward``) the call raised "PagedCache.update outside a paged step"
    from inside the forward."""
    from accelerate.big_modeling import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    model = sharp_model()
    reference = copy.deepcopy(model)
    cpu_offload(model, execution_device="cpu")
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    call = padded_batch([13], 13, seed=3)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    remove_hook_from_module(model, recurse=True)
    with pytest.raises(ValueError, match=r"^model\.forward: nanoserve's patched forward"):
        generate(model, call)
    model.forward = functools.partial(type(model).forward, model)  # the same, by hand
    with pytest.raises(ValueError, match=r"^model\.forward: nanoserve's patched forward"):
        generate(model, call)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    nanoserve.unpatch_model(model)
    assert_same(generate(model, call)[0], generate(reference, call)[0])


def test_hooks_added_after_patching_stay_through_unpatch():
    """Patched, then offloaded (accelerate wraps the patched forward): unpatching keeps
    accelerate's wrapper and gives it the forward from before the patch, so the unpatched
    model runs, with its hooks and after they are removed. Planted: unpatch dropping the
    wrapper left the weights on the meta device ("Tensor on device meta")."""
    from accelerate.big_modeling import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    model = sharp_model()
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    cpu_offload(model, execution_device="cpu")
    call = padded_batch([13], 13, seed=3)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    nanoserve.unpatch_model(model)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    remove_hook_from_module(model, recurse=True)
    assert_same(generate(model, call)[0], generate(reference, call)[0])


def test_a_forward_wrapped_after_patching_through_patch_again_and_unpatch():
    """The user wraps the patched model's forward (a logging wrapper holding the patched
    forward): it runs around the paged forward; patching again and unpatching drop it with
    the forward it holds (kept, it would call the patched forward back from inside the new
    patch's own forward), and a reference to the patched forward kept past unpatching
    refuses. Planted: unpatch keeping such a wrapper made the next patch's forward call
    itself back (a nested paged step: "out of KV blocks")."""
    model = sharp_model()
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    inner, logged = model.forward, []

    def logging_forward(*args, **kwargs):
        logged.append(1)
        return inner(*args, **kwargs)

    model.forward = logging_forward
    call = padded_batch([13], 13, seed=3)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    assert logged
    nanoserve.patch_model(model, block_size=8, num_blocks=64)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    nanoserve.unpatch_model(model)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    with pytest.raises(ValueError, match="^model: not patched"):
        inner(**call)


def test_accelerates_output_cast_after_patching_is_no_hook():
    """``Accelerator.prepare`` under mixed precision wraps the forward with a function of
    accelerate's that casts its outputs (no ``_hf_hook``, no ``_old_forward``): the patched
    forward inside it still runs. Planted: any callable of accelerate's taken for its
    hooked forward refused the call ("model.forward: ... replaced")."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    model = sharp_model()
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    model.forward = types.MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    call = padded_batch([13], 13, seed=3)
    assert_same(generate(model, call)[0], generate(reference, call)[0])
    nanoserve.unpatch_model(model)


def test_scan_names_the_first_hook_of_each_kind():
    """What ``scan_hooks`` finds: nothing on a plain model; a submodule's forward hook rules
    out all three shortcuts; a hook on the model only nanoserve's loop."""
    model = tiny_model("llama")
    assert scan_hooks(model) == (None, None, None)
    handle = model.register_forward_pre_hook(lambda module, args: None)
    assert scan_hooks(model) == (None, None, "a forward hook on the model")
    handle.remove()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: None)
    phrase = "a forward hook on model.layers.1.mlp"
    assert scan_hooks(model) == (phrase, phrase, phrase)
    handle.remove()


def test_a_compiled_patched_model_runs_stocks_forward_and_generates_paged():
    """``torch.compile(model)`` after patching: a forward without a cache (a training step
    with labels) gives stock's loss and logits, and generate on the compiled module keeps
    stock's tokens on the paged cache. Dynamo's "eager" backend keeps the test fast; the
    failure was in its tracing, not in code generation: it rebuilt the stock forward (a
    method bound with ``__get__``) as ``model.forward``, the patched method, which called
    itself until a RecursionError (a probe found it). Planted, reverted: ``stock_method``
    binding with ``__get__``: failed."""
    model = tiny_model("llama", seed=3)
    stock = copy.deepcopy(model)
    inputs = padded_batch([9, 6], 9)
    nanoserve.patch_model(model, block_size=4)
    try:
        compiled = torch.compile(model, backend="eager")
        ours = compiled(**inputs, labels=inputs["input_ids"])
        theirs = stock(**inputs, labels=inputs["input_ids"])
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            tokens = compiled.generate(**inputs, max_new_tokens=6, do_sample=False)
            expected = stock.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, expected)
        assert nanoserve.cache_stats(model)["tokens"] > 0  # the paged cache ran
    finally:
        nanoserve.unpatch_model(model)
        torch._dynamo.reset()


def _calls_from_a_hook(model, other, inputs, seen: list):
    """``model`` with a forward hook on its first layer that runs ``other`` (no cache) on
    ``inputs`` and records the last column's logits."""

    def hook(module, args, out):
        with torch.no_grad():
            seen.append(other(**inputs, use_cache=False).logits[:, -1])

    model.model.layers[0].register_forward_hook(hook)


def test_a_patched_model_called_inside_another_ones_forward_runs_as_stock():
    """A hook of one patched model runs another patched model's forward (a reward or
    reference model scoring on the side): the inner forward has no paged cache and runs
    its attention and mask as before patching, so both models give stock's tokens and
    logits. (Found by a probe: the inner attention took the outer forward's paged step
    and raised an IndexError.)"""
    outer, inner = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    side = padded_batch([7, 4], 7, seed=3)
    inputs = padded_batch([9, 5], 9)
    results = {}
    for name in ("stock", "paged"):
        a, b, seen = copy.deepcopy(outer), copy.deepcopy(inner), []
        if name == "paged":
            nanoserve.patch_model(a, block_size=4)
            nanoserve.patch_model(b, block_size=4)
        _calls_from_a_hook(a, b, side, seen)
        with torch.no_grad():
            tokens = a.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=None)
        results[name] = tokens, torch.stack(seen)
    assert torch.equal(results["paged"][0], results["stock"][0])
    torch.testing.assert_close(results["paged"][1], results["stock"][1], rtol=0, atol=1e-5)


def test_an_unpatched_model_sharing_the_config_inside_a_paged_forward_is_named():
    """An unpatched model that shares the patched model's config runs nanoserve's attention
    (the config names it); inside the patched model's paged forward it would read that
    forward's pools: a RuntimeError says so instead, and the patched model generates again
    once the hook is gone."""
    model = tiny_model("llama", seed=1)
    other = type(model)(model.config).eval()  # the same config object
    nanoserve.patch_model(model, block_size=4)
    seen = []
    handle = model.model.layers[0].register_forward_hook(
        lambda module, args, out: seen.append(other(torch.tensor([[5, 6, 7]])))
    )
    inputs = padded_batch([9, 5], 9)
    with pytest.raises(RuntimeError, match="shares this model's config"), torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
    handle.remove()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert nanoserve.cache_stats(model)["tokens"] > 0


class CountForwards(torch.nn.Module):
    """An identity parametrization that counts the forwards computing its weight."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, weight):
        self.calls += 1
        return weight


def test_a_parametrized_model_in_training_mode_runs_stocks_forwards():
    """``spectral_norm`` updates its buffers at every forward in training mode (an RL loop
    that generates without ``model.eval()``): a patched call runs as many forwards as stock
    (no common prefix computed apart, HF's loop, no capture's warm-up) and leaves the
    buffers as stock does. (Found by a probe and a review: the decode loop ran forwards
    past EOS before reading it back, 6 against stock's 3, and a prefix two prompts share
    was computed in a forward of its own; the next training step's gradients differed.)"""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import spectral_norm

    model = tiny_model("llama", seed=4)
    for layer in model.model.layers:
        spectral_norm(layer.self_attn.q_proj)
        parametrize.register_parametrization(layer.self_attn.k_proj, "weight", CountForwards())
    model.train()  # (no dropout in the tiny model)
    ids = padded_batch([11, 11], 11)["input_ids"]
    ids[1, :8] = ids[0, :8]  # two prompts sharing two full blocks of 4
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        free = copy.deepcopy(model).generate(**inputs, max_new_tokens=8, do_sample=False)
    options = dict(max_new_tokens=8, do_sample=False, eos_token_id=int(free[0, 13]))
    stock = copy.deepcopy(model)
    nanoserve.patch_model(model, block_size=4)
    with torch.no_grad():
        want = stock.generate(**inputs, **options)
        got = model.generate(**inputs, **options)
    assert torch.equal(got, want)
    for a, b in zip(model.model.layers, stock.model.layers, strict=True):
        counted = [layer.self_attn.k_proj.parametrizations.weight[0].calls for layer in (a, b)]
        assert torch.equal(*counted)
        norms = [layer.self_attn.q_proj.parametrizations.weight[0] for layer in (a, b)]
        assert torch.equal(norms[0]._u, norms[1]._u) and torch.equal(norms[0]._v, norms[1]._v)
    assert "parametrization" in nanoserve.decode_graph_stats(model)["decode_loop"]
    scan = scan_hooks(model)
    assert all("parametrization" in phrase for phrase in scan)
