"""fuse_decode: a decode graph step's RMSNorms in one launch each, q/k/v in one launch, a
SiLU-gated MLP in two, and each residual add of a Llama-family layer with the norm after it.

On CPU the graph runner executes its static buffers eagerly (``DecodeGraphs(capture=False)``)
and the kernel runs under the Triton interpreter (``backend="triton"``) on float16 models;
the GPU test (test_gpu_parity) captures real graphs in bfloat16.
"""

from __future__ import annotations

import functools
import sys
import threading

import pytest
import torch
from helpers import NEEDS_INTERPRETER
from test_decode_graphs import generate_patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters import fused_rotary
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.fused_decode import FusedDecode, fits
from nanoserve.adapters.hf_cache import cache_kwarg
from nanoserve.adapters.llama import LLAMA
from nanoserve.adapters.qkv_rotary import QKVRotary
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def run(model, inputs, fuse=True, backend="triton", steps=6):
    patch = {"block_size": 4, "backend": backend, "fuse_decode": fuse}
    return generate_patched(
        model, inputs, patch, DecodeGraphs(capture=False), max_new_tokens=steps, **GREEDY
    )


def fp16_model(name="llama"):
    """A tiny float16 model whose norm weights are not HF's initial ones."""
    model = tiny_model(name).to(torch.float16)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=gen))
    return model


def counts(attention=0, mlp=0, norm=0, rotary=0, residual=0, table=None, ahead=None,
           stored=None):  # fmt: skip
    """The expected ``fused_decode`` counts; the step's cos and sin tables run fused where
    the rotary embedding does, every rotary call takes what the q/k/v launch rotated ahead,
    and every layer so rotated takes the K/V rows that launch stored, unless ``table``,
    ``ahead`` or ``stored`` say otherwise."""
    ahead = rotary if ahead is None else ahead
    return {
        "attention": attention,
        "mlp": mlp,
        "norm": norm,
        "rotary": rotary,
        "residual": residual,
        "rotary_table": int(rotary > 0) if table is None else table,
        "rotary_qkv": ahead,
        "kv_store": ahead if stored is None else stored,
    }


# two layers' input and post-attention norms and the final norm; Qwen3 adds q and k norms
NORMS = {"llama": 5, "qwen2": 5, "qwen3": 9}


def assert_follows(plain, fused, tol=2e-2):
    """``fused`` (generate's output with logits) gives ``plain``'s tokens and logits within
    ``tol``, each row up to a step where plain's two best logits lie within ``tol`` of each
    other and the two took different tokens (another summation order may break a near tie;
    the rows' later steps then see other tokens)."""
    steps = len(plain.logits)
    column = plain.sequences.shape[1] - steps
    live = torch.ones(plain.sequences.shape[0], dtype=torch.bool)
    for step, (a, b) in enumerate(zip(plain.logits, fused.logits, strict=True)):
        a, b = a.float(), b.float()
        torch.testing.assert_close(a[live], b[live], rtol=tol, atol=tol)
        best = a.topk(2).values
        near_tie = best[:, 0] - best[:, 1] <= tol
        same = plain.sequences[:, column + step] == fused.sequences[:, column + step]
        assert bool((same | near_tie | ~live).all()), f"step {step}: other tokens, no near tie"
        live &= same
    assert live.any(), "every row left at a near tie: nothing compared past it"


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases
def test_fused_steps_match_unfused(name, monkeypatch):
    """The fused steps run the Triton kernels themselves (interpreted): q/k/v by the linear
    kernel; the MLP of the decode steps (3 rows, a bucket of 4) by ``fused_mlp`` (its
    two-launch form), of
    the prefill's 27 token rows by the linear kernel's gated form and then down. Planted: k
    and v handed each other's outputs, and the norms' weights dropped: each failed every
    case; the backend not handed to the linear kernel (which then ran its torch reference on
    the CPU): failed; the one-launch MLP's row limit dropped to 0: failed."""
    import nanoserve.kernels.triton_fused_mlp as triton_fused_mlp
    import nanoserve.kernels.triton_linear as triton_linear

    launched = []

    class Recorded:
        def __init__(self, kernel, what):
            self.kernel, self.what = kernel, what

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(self.what(args, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    linear = Recorded(triton_linear._linear_kernel, lambda a, k: ("gated", k["GATED"], a[2]))
    mlp = Recorded(triton_fused_mlp._fused_mlp_kernel, lambda a, k: ("mlp", k["PHASES"], a[2]))
    monkeypatch.setattr(triton_linear, "_linear_kernel", linear)
    monkeypatch.setattr(triton_fused_mlp, "_fused_mlp_kernel", mlp)
    model = fp16_model(name)
    inputs = padded_batch([9, 4, 7], 9)
    plain, plain_stats = run(model, inputs, fuse=False)
    assert launched == []
    fused, stats = run(model, inputs, fuse=True)
    # (kind, GATED or PHASES, rows): both layers, the prefill then 5 decode steps
    assert set(launched) == {
        ("gated", False, 27), ("gated", True, 27), ("gated", False, 4), ("mlp", 1, 4),
        ("mlp", 2, 4),
    }  # fmt: skip
    assert launched.count(("mlp", 1, 4)) == 2 * 5
    assert plain_stats["fused_decode"] == counts()
    # (Qwen3 normalizes q and k before the rotation: no rotation ahead)
    ahead = 0 if name == "qwen3" else None
    assert stats["fused_decode"] == counts(2, 2, NORMS[name], rotary=2, residual=4, ahead=ahead)
    assert stats["replays"] == plain_stats["replays"] == 5
    assert_follows(plain, fused)
    for layer in model.model.layers:  # nothing of the fused forwards is left behind
        modules = [getattr(layer.self_attn, n) for n in PROJECTIONS] + [layer.mlp]
        modules += [layer.input_layernorm, layer.post_attention_layernorm, model.model.norm]
        assert not any("forward" in m.__dict__ for m in modules)


@NEEDS_INTERPRETER
def test_interpreted_bfloat16_projections_run_stock():
    """The interpreter's bfloat16 dot is wrong (``small_batch_linear`` refuses it): the
    fused forwards take the projections only in float16 there. Planted: the check dropped:
    fits answered True for bfloat16."""
    linear = torch.nn.Linear(64, 32, bias=False)
    for dtype, taken in ((torch.float16, True), (torch.bfloat16, False)):
        linear.to(dtype)
        with torch.no_grad():
            assert fits(torch.randn(3, 64).to(dtype), [linear], "triton") is taken


def test_the_mlp_runs_in_one_launch_up_to_16_rows_without_biases():
    """``fused_mlp`` takes up to 16 rows, no bias and no gradient to record; past that (or
    with a bias, or a down weight autograd would track) the MLP runs as the gated linear
    kernel and then down, as before (which refuse the gradient too). Planted: the bias
    check dropped, the gradient check dropped: each failed."""
    from nanoserve.adapters.fused_decode import one_launch_fits

    def linears(bias):
        shapes = ((32, 48), (32, 48), (48, 32))
        return [torch.nn.Linear(*s, bias=bias).half().requires_grad_(False) for s in shapes]

    plain, biased = linears(False), linears(True)
    assert one_launch_fits(torch.randn(16, 32).half(), plain)
    assert not one_launch_fits(torch.randn(17, 32).half(), plain)
    assert not one_launch_fits(torch.randn(4, 32).half(), biased)
    mixed = plain[:2] + biased[2:]  # (a bias on down alone)
    assert not one_launch_fits(torch.randn(4, 32).half(), mixed)
    plain[2].weight.requires_grad_(True)
    with torch.enable_grad():
        assert not one_launch_fits(torch.randn(4, 32).half(), plain)
    with torch.no_grad():
        assert one_launch_fits(torch.randn(4, 32).half(), plain)


def test_float32_and_torch_backend_are_not_fused():
    inputs = padded_batch([5, 3], 5)
    _, stats = run(tiny_model("llama"), inputs, backend="auto")
    assert stats["fused_decode"] == counts()  # float32: stock's modules, exact
    _, stats = run(fp16_model(), inputs, backend="torch")
    assert stats["fused_decode"] == counts()


@NEEDS_INTERPRETER
def test_a_bucket_of_32_rows_runs_fused(monkeypatch):
    """Past 16 rows a program holds 32 (or 64) rows of x; the down projection runs on
    cuBLAS there. Planted: DOWN_MAX_ROWS raised to 64: failed."""
    from nanoserve.adapters import fused_decode

    launched = []
    kernel = fused_decode.small_batch_linear

    def counted(x, weights, *args, **kwargs):
        launched.append((x.shape[0], len(weights)))
        return kernel(x, weights, *args, **kwargs)

    monkeypatch.setattr(fused_decode, "small_batch_linear", counted)
    rotary_kernel = fused_decode.small_batch_linear_rotary

    def counted_rotary(x, weights, *args, **kwargs):
        launched.append((x.shape[0], len(weights)))
        return rotary_kernel(x, weights, *args, **kwargs)

    monkeypatch.setattr(fused_decode, "small_batch_linear_rotary", counted_rotary)
    model = fp16_model()
    inputs = padded_batch([5, 3, 4, 2, 5] * 4, 5)  # 20 rows: bucket of 32
    plain, _ = run(model, inputs, fuse=False, steps=3)
    fused, stats = run(model, inputs, steps=3)
    assert stats["fused_decode"] == counts(2, 2, 5, 2, residual=4)
    # q/k/v (three weights) and gate/up (two) of both layers in both steps; no down
    assert sorted(launched) == [(32, 2)] * 4 + [(32, 3)] * 4
    for a, b in zip(plain.logits, fused.logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@NEEDS_INTERPRETER
def test_more_rows_than_the_kernel_takes_run_stock_projections(monkeypatch):
    """q/k/v run stock's past 64 rows, and the MLP's products too, its SiLU and product in
    one ``silu_mul``; the norms and the rotary embedding take any number. Planted: both row
    limits dropped (``active``'s and the kernel's): failed (either alone keeps stock's
    projections)."""
    from nanoserve.adapters import fused_decode

    launched = []
    kernel = fused_decode.small_batch_linear
    monkeypatch.setattr(
        fused_decode,
        "small_batch_linear",
        lambda x, *a, **k: launched.append(x.shape[0]) or kernel(x, *a, **k),
    )
    inputs = padded_batch([5] * 65, 5)  # bucket of 128 rows; the prefill's 325 token rows
    _, stats = run(fp16_model(), inputs, steps=3)
    assert stats["fused_decode"] == counts(mlp=2, norm=5, rotary=2, residual=4, ahead=0)
    assert stats["replays"] == 2
    assert launched == []


class _Scaled(torch.nn.Linear):
    """A Linear subclass that computes more (as LoRA or a quantized layer would)."""

    def forward(self, x):
        return super().forward(x) * 2


@NEEDS_INTERPRETER
def test_subclassed_projections_keep_their_forwards():
    """Planted: the subclass check dropped from ``plain_linear``: failed."""
    model = fp16_model()
    layer = model.model.layers[0]
    k = layer.self_attn.k_proj
    scaled = _Scaled(k.in_features, k.out_features, bias=False, dtype=torch.float16)
    scaled.weight.data.copy_(k.weight.data)
    layer.self_attn.k_proj = scaled
    inputs = padded_batch([6, 2], 6)
    plain, _ = run(model, inputs, fuse=False)
    fused, stats = run(model, inputs)
    # layer 0's attention: k is a subclass (its rotation by a launch of its own)
    assert stats["fused_decode"] == counts(1, 2, 5, 2, residual=4, ahead=1)
    assert_follows(plain, fused)


@NEEDS_INTERPRETER
def test_a_submodule_hook_keeps_the_call_off_the_graphs():
    """A replay would skip a submodule's hook (on the GPU it runs no Python), so a call that
    finds one runs every step eagerly and the hook sees every step, as under stock; the
    model's own hooks run around its forward and keep the graphs, as tensor parallelism's
    (captured with the step) and transformers' output capturing (inactive there) do.
    Planted: the hook check dropped from graph_step_kind, and those libraries' hooks
    counted: each failed."""
    model = fp16_model()
    calls = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: calls.append(o.shape[0])
    )
    inputs = padded_batch([6, 2], 6)
    _, stats = run(model, inputs, steps=4)
    # nor do its eager steps run fused forwards, which the hook could see
    assert stats["replays"] == 0 and stats["fused_decode"] == counts()
    assert stats["eager_reason"] == "a forward hook on model.layers.0.mlp.down_proj"
    assert len(calls) == 4  # the prefill and three decode steps
    handle.remove()

    def redistribute(module, args):  # as torch.distributed's tensor-parallel hooks are
        return None

    redistribute.__module__ = "torch.distributed.tensor._api"
    model.model.layers[1].mlp.register_forward_pre_hook(functools.partial(redistribute))
    with torch.no_grad():  # transformers installs its output-capturing hooks for good
        model(**padded_batch([3], 3), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.model.layers)
    model.register_forward_hook(lambda *args: calls.append("model"))
    _, stats = run(model, inputs, steps=4)
    assert stats["replays"] == 3 and stats["eager_reason"] is None
    assert calls[4:] == ["model"] * 4


def test_the_switch_is_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="fuse_decode"):
        nanoserve.patch_model(model, fuse_decode="yes")
    with pytest.raises(ValueError, match="fuse_decode"):
        nanoserve.PagedConfig(fuse_decode=1)


@NEEDS_INTERPRETER
def test_a_hook_added_after_the_first_call_runs():
    """A hook added between calls keeps the next call off the graphs (a replay would run no
    Python hook); so does one added before a forward of the caller's own on a returned
    cache, which looks again at each forward. Planted: the call's check dropped, and the
    direct forward's check dropped: each failed."""
    model = fp16_model()
    inputs = padded_batch([6, 2], 6)
    nanoserve.patch_model(model, block_size=4, backend="triton")
    state_of(model).graphs = DecodeGraphs(capture=False)
    try:
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=3, **GREEDY)
            replays = nanoserve.decode_graph_stats(model)["replays"]
            assert replays == 2
            cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: None)
            grown = torch.ones(2, out.sequences.shape[1] - 6, dtype=torch.long)
            mask = torch.cat([inputs["attention_mask"], grown], dim=1)
            step = dict(input_ids=out.sequences[:, -1:], attention_mask=mask, use_cache=True)
            positions = cache.paged.seq_lens()
            step["position_ids"] = torch.tensor(positions).view(-1, 1)
            model(**step, **{cache_kwarg(type(model)): cache})  # the caller's own step
            stats = nanoserve.decode_graph_stats(model)
            assert stats["replays"] == replays  # eager
            assert stats["eager_reason"] == "a forward hook on model.layers.1.mlp.down_proj"
            model.generate(**inputs, max_new_tokens=3, **GREEDY)
            assert nanoserve.decode_graph_stats(model)["replays"] == replays
            handle.remove()
            model.generate(**inputs, max_new_tokens=3, **GREEDY)
            stats = nanoserve.decode_graph_stats(model)
            assert stats["replays"] == replays + 2 and stats["eager_reason"] is None
    finally:
        nanoserve.unpatch_model(model)


@NEEDS_INTERPRETER
def test_wrapped_forwards_and_capturing_configs_keep_calls_off_the_graphs():
    """An accelerate-style wrapped forward (offload hooks move weights in Python) and a
    config that turns transformers' output capturing on in every forward run eagerly;
    enable_input_require_grads' hook (autograd only) and tensor parallelism's wrapped
    forwards keep the graphs. Planted: the wrapped-forward check dropped, the config check
    dropped, and the exemption of tensor parallelism's wrappers dropped: each failed."""
    model = fp16_model()
    inputs = padded_batch([6, 2], 6)
    mlp = model.model.layers[0].mlp
    stock_forward = mlp.forward
    mlp.forward = lambda x: stock_forward(x)  # as accelerate's add_hook_to_module does
    _, stats = run(model, inputs, steps=3)
    assert stats["replays"] == 0
    assert stats["eager_reason"] == "a wrapped forward on model.layers.0.mlp"
    del mlp.forward

    def tp_forward(x):  # as transformers' tensor-parallel layers wrap theirs
        return stock_forward(x)

    tp_forward.__module__ = "transformers.distributed.tensor_parallel"
    mlp.forward = tp_forward
    model.enable_input_require_grads()
    _, stats = run(model, inputs, steps=3)
    assert stats["replays"] == 2 and stats["eager_reason"] is None
    model.config.output_hidden_states = True
    _, stats = run(model, inputs, steps=3)
    assert stats["replays"] == 0 and "output_hidden_states" in stats["eager_reason"]


@NEEDS_INTERPRETER
def test_a_pre_hook_on_a_sibling_leaves_the_group_unfused():
    """A pre-hook may change v's input after q ran (here in place): v must see it. (A call
    that finds hooks at its start replays nothing; this guards hooks added within a call.)
    Planted: the pre-hook check dropped: failed."""
    model = fp16_model()
    attention = model.model.layers[0].self_attn
    fused = FusedDecode(model.model, model.model.layers, LLAMA, "triton")

    def scale_in_place(module, args):
        args[0].mul_(1.5)

    attention.v_proj.register_forward_pre_hook(scale_in_place)
    x = torch.randn(2, 1, attention.q_proj.in_features).half()
    first = x.clone()
    with torch.no_grad(), fused.active(2):
        q, v = attention.q_proj(x), attention.v_proj(x)
    weights = (attention.q_proj.weight, attention.v_proj.weight)
    assert torch.equal(q, torch.nn.functional.linear(first, weights[0]))
    assert torch.equal(v, torch.nn.functional.linear(first * 1.5, weights[1]))


@NEEDS_INTERPRETER
def test_modules_shared_between_layers_are_swapped_once():
    """Planted: every layer's modules swapped (a shared one twice): the step raised and left
    fused forwards behind."""
    model = fp16_model()
    first, second = model.model.layers
    second.self_attn.k_proj = first.self_attn.k_proj
    second.mlp = first.mlp
    inputs = padded_batch([6, 2], 6)
    plain, _ = run(model, inputs, fuse=False)
    fused, stats = run(model, inputs)
    # the shared MLP is followed by two norms: its adds stay apart; the second layer's
    # rotation by a launch of its own
    assert stats["fused_decode"] == counts(1, 1, 5, 2, residual=2, ahead=1)
    for a, b in zip(plain.logits, fused.logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for module in model.modules():
        assert "forward" not in module.__dict__


def test_autocast_leaves_stock_modules():
    from nanoserve.adapters.fused_decode import fits

    linear = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fits(x, [linear], "torch")


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fused_rotary_is_stock_bit_for_bit(name, monkeypatch):
    """Every fused rotary call of a step gives what the module's own function gives on the
    same tensors, and the global is the original again after the call. Planted: the stand-in
    left installed after the step, and the products summed before rounding: each failed."""
    model = fp16_model(name)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb
    compared = []
    fused = fused_rotary.apply_rotary

    def checked(q, k, cos, sin, backend):
        out = fused(q, k, cos, sin, backend=backend)
        expected = original(q, k, cos, sin)
        compared.append(all(torch.equal(a, b) for a, b in zip(out, expected, strict=True)))
        return out

    monkeypatch.setattr(fused_rotary, "apply_rotary", checked)
    take = QKVRotary.take

    def checked_ahead(self, q, k, cos, sin):
        out = take(self, q, k, cos, sin)
        if out is not None:
            expected = original(q, k, cos, sin)
            compared.append(all(torch.equal(a, b) for a, b in zip(out, expected, strict=True)))
        return out

    monkeypatch.setattr(QKVRotary, "take", checked_ahead)
    _, stats = run(model, padded_batch([7, 3, 5], 7), steps=4)
    assert stats["fused_decode"]["rotary"] == 2
    # two layers, the prefill and three decode steps
    assert len(compared) == 2 * 4 and all(compared)
    assert module.apply_rotary_pos_emb is original


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["gemma", "gemma2"])
def test_gemma_attention_fuses_rotary_and_projections(name):
    """Gemma's attention classes call Llama's rotary; its norms and GELU MLP stay stock's."""
    from test_new_families import tiny_model as gemma_model

    model = gemma_model(name).to(torch.float16)
    inputs = padded_batch([6, 2], 6)
    plain, _ = run(model, inputs, fuse=False)
    fused, stats = run(model, inputs)
    layers = len(model.model.layers)
    assert stats["fused_decode"] == counts(attention=layers, rotary=layers)
    for a, b in zip(plain.logits, fused.logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@NEEDS_INTERPRETER
def test_rotary_swap_is_this_threads_and_undone():
    """Other threads meet the original while a swap is open; nested users put it back once
    the last leaves, and a global set by someone else meanwhile stays theirs."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    q = torch.randn(1, 2, 1, 8).half()
    cos, sin = torch.rand(1, 1, 8).half(), torch.rand(1, 1, 8).half()
    fused_calls = []
    with fused_rotary.swapped([modeling_llama], "triton", lambda: fused_calls.append(1)):
        seen = []
        worker = threading.Thread(
            target=lambda: seen.append(modeling_llama.apply_rotary_pos_emb(q, q, cos, sin))
        )
        worker.start()
        worker.join()
        assert fused_calls == [] and torch.equal(seen[0][0], original(q, q, cos, sin)[0])
        with fused_rotary.swapped([modeling_llama], "triton", lambda: fused_calls.append(2)):
            modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
        assert fused_calls == [2] and modeling_llama.apply_rotary_pos_emb is not original
        modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
        modeling_llama.apply_rotary_pos_emb(q, q.float(), cos, sin)  # not fusable: original
        assert fused_calls == [2, 1]
    assert modeling_llama.apply_rotary_pos_emb is original
    try:
        with fused_rotary.swapped([modeling_llama], "triton", lambda: None):
            modeling_llama.apply_rotary_pos_emb = theirs = lambda *args: args
        assert modeling_llama.apply_rotary_pos_emb is theirs
    finally:
        modeling_llama.apply_rotary_pos_emb = original


@NEEDS_INTERPRETER
def test_rotary_stand_in_falls_back_where_it_must():
    """Another library's rotary (as Liger installs) is never replaced; a swap of another
    module does not fuse this one's calls; a module without the global is skipped before
    anything changes; partial rotary (cos narrower than the head) and autograd run the
    original. Planted: the own-function check dropped, the innermost user taken whatever
    it swapped, and the autograd check dropped: each failed."""
    from types import ModuleType

    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    original = modeling_llama.apply_rotary_pos_emb
    q = torch.randn(1, 2, 1, 8).half()
    cos, sin = torch.rand(1, 1, 8).half(), torch.rand(1, 1, 8).half()
    fused = []
    try:
        modeling_llama.apply_rotary_pos_emb = theirs = lambda q, k, cos, sin: (q * 0, k * 0)
        assert (
            fused_rotary.rotary_modules(
                [fp16_model().model.layers[0].self_attn], LLAMA.rotary_attention_classes
            )
            == ()
        )
        with fused_rotary.swapped([modeling_llama], "triton", lambda: fused.append(1)):
            assert modeling_llama.apply_rotary_pos_emb is theirs
            assert not modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)[0].any()
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    with fused_rotary.swapped(
        [modeling_llama, ModuleType("bare")], "triton", lambda: fused.append(1)
    ):
        with fused_rotary.swapped([modeling_qwen2], "triton", lambda: fused.append(2)):
            modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)  # the outer user's module
        assert fused == [1]
        grad_q = q.float().requires_grad_().half()
        out = modeling_llama.apply_rotary_pos_emb(grad_q, grad_q, cos, sin)
        assert out[0].grad_fn is not None and fused == [1]
    assert modeling_llama.apply_rotary_pos_emb is original
    assert modeling_qwen2.apply_rotary_pos_emb.__module__ == modeling_qwen2.__name__
    from transformers.models.phi3 import modeling_phi3

    partial = modeling_phi3.apply_rotary_pos_emb
    with fused_rotary.swapped([modeling_phi3], "triton", lambda: fused.append(3)):
        out = modeling_phi3.apply_rotary_pos_emb(q, q, cos[..., :4], sin[..., :4])
    assert fused == [1] and torch.equal(out[0], partial(q, q, cos[..., :4], sin[..., :4])[0])


def test_rotary_is_swapped_only_for_the_familys_attention():
    """compile_decode builds FusedDecode with rotary=False; Phi-3's partial rotary is not
    Llama's and its class is not in the family's list."""
    from test_new_families import tiny_model as other_model

    model = fp16_model()
    layers = model.model.layers
    assert FusedDecode(model.model, layers, LLAMA, "torch").rotary_modules
    assert FusedDecode(model.model, layers, LLAMA, "torch", rotary=False).rotary_modules == ()
    phi = other_model("phi3")
    assert fused_rotary.rotary_modules([phi.model.layers[0].self_attn], ("LlamaAttention",)) == ()


@NEEDS_INTERPRETER
def test_a_kernelized_rotary_keeps_its_hub_kernel():
    """With the ``kernels`` package (transformers 5.25 requires it) the modeling module's
    global is a ``kernels`` wrapper, which fuses; once ``kernels.kernelize`` points an
    attention's own wrapper at a Hub kernel, every rotary call of that module runs the
    kernel, as unfused. Planted: the kernelized check dropped: failed."""
    pytest.importorskip("kernels")
    from types import MethodType

    model = fp16_model()
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    if not isinstance(module.apply_rotary_pos_emb, torch.nn.Module):
        pytest.skip("this transformers does not wrap apply_rotary_pos_emb (before 5.25)")
    inner = fused_rotary._kernels_wrapped(module.apply_rotary_pos_emb)
    assert inner is not None and inner.__name__ == "apply_rotary_pos_emb"
    inputs = padded_batch([5, 3], 5)
    _, stats = run(model, inputs, steps=3)
    assert stats["fused_decode"]["rotary"] == 2
    calls = []

    def hub_kernel(self, q, k, cos, sin, unsqueeze_dim=1):
        calls.append(q.shape)
        return inner(q, k, cos, sin, unsqueeze_dim)

    wrapper = next(iter(model.model.layers[1].self_attn._kernel_funcs.values()))
    wrapper.forward = MethodType(hub_kernel, wrapper)  # what kernelize does
    plain, _ = run(model, inputs, fuse=False, steps=3)
    unfused_calls, calls[:] = len(calls), []
    fused, stats = run(model, inputs, steps=3)
    assert stats["fused_decode"]["rotary"] == 0
    assert unfused_calls >= 3 and len(calls) == unfused_calls
    assert torch.equal(plain.sequences, fused.sequences)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_residual_adds_with_their_norms_change_no_bit(name, monkeypatch):
    """A residual add run with the norm after it gives the bits of the add and of the norm
    apart: the same tokens and logits, bit for bit, as the fused step without it, and every
    o_proj's forward its own again after. Planted: the norm after an MLP taken from the
    layer's own post-attention norm, and eps dropped from the fused launch: each failed."""
    from nanoserve.adapters import fused_residual

    model = fp16_model(name)
    inputs = padded_batch([9, 4, 7], 9)
    together, stats = run(model, inputs)
    assert stats["fused_decode"]["residual"] == 4  # two layers, two adds each
    monkeypatch.setattr(fused_residual, "_ADDS", set())  # no add is watched
    apart, apart_stats = run(model, inputs)
    assert apart_stats["fused_decode"] == {**stats["fused_decode"], "residual": 0}
    assert torch.equal(together.sequences, apart.sequences)
    for a, b in zip(together.logits, apart.logits, strict=True):
        assert torch.equal(a, b)
    assert not any("forward" in m.__dict__ for m in model.modules())


@NEEDS_INTERPRETER
def test_only_an_add_of_a_noted_output_is_fused():
    """An add of a noted sublayer output to a tensor of its shape and dtype runs fused, once;
    broadcast adds, other dtypes, extra arguments and other tensors run as before, and the
    kept norm serves only the very sum tensor it was computed from."""
    from nanoserve.adapters.fused_residual import ResidualNorms
    from nanoserve.kernels.rms_norm import rms_norm

    model = fp16_model()
    layers = model.model.layers
    norms = {id(m) for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"}
    ran = set()
    classes = ("LlamaDecoderLayer",)
    residual = ResidualNorms(layers, model.model.norm, classes, norms, "triton", ran)
    o_proj, post_norm = layers[0].self_attn.o_proj, layers[0].post_attention_layernorm
    x = torch.randn(3, 1, o_proj.out_features).to(torch.float16)
    out = torch.randn_like(x)
    residual.note(o_proj, out)
    assert not residual.noted  # outside a step nothing is noted (nor kept alive)
    residual.watching = True  # (as inside active(), without its watch of every add)
    residual.note(o_proj, out)
    assert residual.fuse(x[:, :, :1], out) is None  # broadcast: no
    assert residual.fuse(x.float(), out) is None  # other dtype: no
    assert residual.fuse(x, out.clone()) is None  # not the noted tensor: no
    total = residual.fuse(x, out)
    assert torch.equal(total, x + out) and not ran
    assert residual.fuse(x, out) is None  # noted once, fused once
    assert residual.take(post_norm, total.clone()) is None  # held for that very tensor only
    residual.note(o_proj, out)
    total = residual.fuse(out, x)
    weight, eps = post_norm.weight, post_norm.variance_epsilon
    expected = rms_norm(x + out, weight, eps, backend="triton")
    assert torch.equal(residual.take(post_norm, total), expected)
    assert ran == {("residual", 0)}  # counted where the norm is taken
    assert residual.take(post_norm, total) is None  # taken once
    with residual.active():
        assert torch.equal(torch.add(x, out, alpha=2), x + 2 * out)  # extra argument: as before
        assert "forward" in o_proj.__dict__
    assert "forward" not in o_proj.__dict__


def test_residual_adds_stay_apart_under_compile_decode():
    """compile_decode's compiler fuses the adds with the norms itself (a watched add would
    break its graph); without it the Llama family's adds are fused, Gemma's never."""
    from types import SimpleNamespace

    from test_new_families import tiny_model as gemma_model

    from nanoserve.adapters.graph_forward import _fused

    def residual_of(model, compile_decode):
        state = SimpleNamespace(
            fuse_decode=True, backend="auto", compile_decode=compile_decode, fused_decode=None
        )
        _fused(model, state, rows=1)
        return state.fused_decode.residual

    llama = fp16_model()
    assert residual_of(llama, compile_decode=True) is None
    fused = residual_of(llama, compile_decode=False)
    assert fused.o_projs == [layer.self_attn.o_proj for layer in llama.model.layers]
    assert residual_of(gemma_model("gemma").to(torch.float16), compile_decode=False) is None


@NEEDS_INTERPRETER
def test_no_function_mode_is_left_behind():
    """The add watch is a TorchFunctionMode for the step only: none is active after a call,
    and none after a step that raised."""
    model = fp16_model()
    run(model, padded_batch([5, 3], 5), steps=3)
    assert torch._C._len_torch_function_stack() == 0
    fused = FusedDecode(model.model, model.model.layers, LLAMA, "triton")
    with pytest.raises(RuntimeError, match="planted"), fused.active(rows=2):
        assert torch._C._len_torch_function_stack() == 1
        raise RuntimeError("planted")
    assert torch._C._len_torch_function_stack() == 0
    assert not any("forward" in m.__dict__ for m in model.modules())


@NEEDS_INTERPRETER
@pytest.mark.parametrize(("lengths", "small"), [([40, 30], False), ([20], True)])
def test_prefill_steps_run_fused(lengths, small, monkeypatch):
    """A prompt's prefill (eager: the call's first step makes the pool) runs the norms, the
    rotary embedding and the MLP fused: q/k/v and the MLP's products by the small-batch
    kernel up to 64 token rows, past it q/k/v stock's and the MLP by cuBLAS's products and
    one ``silu_mul``; an eager step watches no add (no TorchFunctionMode). FUSE_PREFILL off
    leaves the prefill stock's. Planted: the eager step's context dropped, and the MLP's
    ``silu_mul`` path dropped: each failed."""
    from nanoserve.adapters import fused_decode, graph_forward

    seen = []

    def recorded(name, kernel):
        def call(x, *args, **kwargs):
            seen.append((name, x.numel() // x.shape[-1]))
            assert torch._C._len_torch_function_stack() == 0  # no add watch
            return kernel(x, *args, **kwargs)

        return call

    for name in ("silu_mul", "small_batch_linear", "small_batch_linear_rotary", "rms_norm"):
        monkeypatch.setattr(fused_decode, name, recorded(name, getattr(fused_decode, name)))
    model = fp16_model()
    width = max(lengths)
    inputs = padded_batch(lengths, width)
    plain, _ = run(model, inputs, fuse=False, steps=1)
    assert seen == []
    fused, stats = run(model, inputs, steps=1)  # the prefill only
    tokens = len(lengths) * width
    if small:  # q/k/v (with the rotation) and gate/up per layer
        assert seen.count(("small_batch_linear_rotary", tokens)) == 2
        assert seen.count(("small_batch_linear", tokens)) == 2
    else:
        assert seen.count(("silu_mul", tokens)) == 2
    assert seen.count(("rms_norm", tokens)) == 5
    # (the first step's write makes the pools: no launch before it could store K/V rows)
    expected = counts(2 if small else 0, 2, 5, 2, residual=0, ahead=2 if small else 0, stored=0)
    assert stats["fused_decode"] == expected
    assert_follows(plain, fused)
    seen.clear()
    monkeypatch.setattr(graph_forward, "FUSE_PREFILL", False)
    run(model, inputs, steps=1)
    assert seen == []
    state = type("State", (), {"backend": "triton"})()
    cache = type("Cache", (), {"submodule_hooks": None})()
    context = graph_forward.eager_fused(model, state, cache, inputs, autograd=True)
    assert type(context).__name__ == "nullcontext"  # autograd records stock's modules


@NEEDS_INTERPRETER
def test_a_sibling_input_written_in_place_is_computed_again():
    """q computes k and v with it; when the input is written in place between q's call and
    v's (by code between them, no hook), v computes its own from what it sees. Planted: the
    version check dropped: failed."""
    model = fp16_model()
    attention = model.model.layers[0].self_attn
    fused = FusedDecode(model.model, model.model.layers, LLAMA, "triton")
    x = torch.randn(2, 1, attention.q_proj.in_features).half()
    first = x.clone()
    with torch.no_grad(), fused.active(2):
        q = attention.q_proj(x)
        x.mul_(1.5)
        v = attention.v_proj(x)
    weights = (attention.q_proj.weight, attention.v_proj.weight)
    assert torch.equal(q, torch.nn.functional.linear(first, weights[0]))
    assert torch.equal(v, torch.nn.functional.linear(first * 1.5, weights[1]))


@NEEDS_INTERPRETER
@pytest.mark.parametrize("cls_name", ["LlamaRMSNorm", "LlamaMLP"])
def test_a_forward_set_on_the_class_is_honoured(cls_name, monkeypatch):
    """A forward set on a family class after import (an ablation, an instrumentation patch)
    runs as under stock, in prefill and decode: the family trusts the class by its name only
    while the class runs its modeling file's forward. Planted: the check dropped (the fused
    norm or MLP ran instead): failed."""
    from transformers.models.llama import modeling_llama

    cls = getattr(modeling_llama, cls_name)
    original = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, x: original(self, x) * 0.5)
    model = fp16_model()
    inputs = padded_batch([9, 4, 7], 9)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=4, **GREEDY)
    fused, stats = run(model, inputs, steps=4)
    assert stats["fused_decode"]["norm" if cls_name == "LlamaRMSNorm" else "mlp"] == 0
    assert_follows(stock, fused)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("by", ["hook", "layer class"])
def test_gradients_through_a_tensor_added_in_the_forward(by, monkeypatch):
    """Weights frozen, a trainable vector added to layer 0's output (by a forward hook, or by
    a forward set on the decoder layer class, which no hook scan sees), and the caller's own
    forward on a returned cache under grad: the layers after it record autograd, so their
    norms, projections, K/V write and attention run stock's or the references, and the
    vector's gradient is stock's. Planted: the per-layer checks of the K/V write and of the
    attention dropped: each failed both cases; the fused norm's dropped: the layer class
    case failed. (The projections' own check shows on CUDA only: on the CPU their small-batch
    kernel runs its reference under backend "auto", which records autograd.)"""
    from transformers.models.llama import modeling_llama

    inputs = padded_batch([9, 5], 9)
    grads = []
    for patch in (None, dict(block_size=4, backend="triton")):
        model = fp16_model()
        model.requires_grad_(False)
        with torch.no_grad():  # sublayers whose share of the gradient is above rounding
            for weight in (p for n, p in model.model.layers.named_parameters() if "proj" in n):
                weight.mul_(8)
        steer = torch.zeros(model.config.hidden_size, dtype=torch.float16, requires_grad=True)
        first = model.model.layers[0]
        if by == "hook":
            first.register_forward_hook(lambda m, a, out, s=steer: out + s)
        else:
            layer_forward = modeling_llama.LlamaDecoderLayer.forward

            def forward(self, *args, _s=steer, _first=first, _f=layer_forward, **kwargs):
                out = _f(self, *args, **kwargs)
                return out + _s if self is _first else out

            monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)
        if patch is not None:
            nanoserve.patch_model(model, **patch)
        try:
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=1, **GREEDY)
            mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
            step = dict(input_ids=out.sequences[:, -1:], attention_mask=mask, use_cache=True)
            step["position_ids"] = (mask.cumsum(-1) - 1)[:, -1:]
            with torch.enable_grad():
                logits = model(**step, **{cache_kwarg(type(model)): out.past_key_values}).logits
                logits.float().sum().backward()
            grads.append(steer.grad.float())
        finally:
            if patch is not None:
                nanoserve.unpatch_model(model)
            monkeypatch.undo()
    assert grads[0].norm() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-2, atol=1e-2)
