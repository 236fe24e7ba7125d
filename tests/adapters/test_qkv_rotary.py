"""``QKVRotary``: the rotation the q/k/v launch computed is handed out only for exactly the
views it rotated, unchanged, with the very tables it used, once (CPU, Triton's
interpreter)."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import NEEDS_INTERPRETER
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nanoserve.adapters.qkv_rotary import QKVRotary
from nanoserve.kernels.rotary import rotary_cos_sin
from nanoserve.kernels.small_batch_linear import small_batch_linear_rotary

BATCH, SEQ, HIDDEN, Q_HEADS, KV_HEADS, DIM = 2, 3, 64, 4, 2, 16


def _step(gen_seed: int = 0):
    """(holder, x, weights, q view, k view, cos, sin) after one launch kept its rotation."""
    gen = torch.Generator().manual_seed(gen_seed)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen).half()
    sizes = (Q_HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM)
    weights = [(torch.randn(n, HIDDEN, generator=gen) / 8).half() for n in sizes]
    positions = torch.randint(0, 4000, (BATCH, SEQ), generator=gen)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM)
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.0, torch.float16, backend="torch")
    holder = QKVRotary()
    holder.reset(enabled=True)
    holder.note_tables(cos, sin)
    flat = x.view(-1, HIDDEN)
    tables = holder.tables_for(x, flat, weights)
    assert tables is not None
    out, q_rot, k_rot = small_batch_linear_rotary(flat, weights, None, *tables, backend="triton")
    outs = [y.view(BATCH, SEQ, -1) for y in out.split(sizes, dim=-1)]
    holder.keep(outs[0], outs[1], q_rot, k_rot, out)
    # as the attention module views them
    q = outs[0].view(BATCH, SEQ, -1, DIM).transpose(1, 2)
    k = outs[1].view(BATCH, SEQ, -1, DIM).transpose(1, 2)
    return holder, q, k, cos, sin


@NEEDS_INTERPRETER
def test_the_views_it_rotated_get_eager_bits_once():
    holder, q, k, cos, sin = _step()
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    held = holder.take(q, k, cos, sin)
    assert held is not None
    for out, ref in zip(held, expected, strict=True):
        assert out.shape == ref.shape and torch.equal(out, ref)
    assert holder.take(q, k, cos, sin) is None  # once


def _written_in_place(q, k, cos, sin):
    q.mul_(2)
    return q, k, cos, sin


def _normalized_first(q, k, cos, sin):
    return q * 1.0, k, cos, sin


def _other_tables(q, k, cos, sin):
    return q, k, cos.clone(), sin


def _tables_written(q, k, cos, sin):
    sin.add_(0)
    return q, k, cos, sin


def _another_view(q, k, cos, sin):
    return q[:1], k[:1], cos, sin


def _swapped(q, k, cos, sin):
    return k, q, cos, sin


@NEEDS_INTERPRETER
@pytest.mark.parametrize(
    "change",
    [_written_in_place, _normalized_first, _other_tables, _tables_written, _another_view,
     _swapped],
)  # fmt: skip
def test_anything_else_is_refused(change):
    """Planted: the version check dropped (in place: failed), the view check dropped (the
    normalized copy, another view and the swap: failed), the tables' identity check dropped
    (other tables: failed)."""
    holder, q, k, cos, sin = _step()
    assert holder.take(*change(q, k, cos, sin)) is None


def test_no_tables_without_the_rotation_running():
    holder = QKVRotary()
    holder.reset(enabled=False)
    holder.note_tables(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    x = torch.zeros(1, 1, 8)
    assert holder.tables_for(x, x.view(1, 8), [torch.zeros(4, 8)] * 3) is None


@NEEDS_INTERPRETER
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_hook_on_a_projection_keeps_the_rotation_apart(mode):
    """A forward hook that writes k_proj's output in place: the rotation must see the
    written k. Under ``inference_mode`` no version counter moves, so the launch must not
    rotate ahead at all for that layer (found by a review: it handed back the rotation of
    the k from before the hook). Planted: ``_rotates_ahead``'s hook check dropped: the
    inference-mode case failed."""
    from test_families import tiny_model

    from nanoserve.adapters.fused_decode import FusedDecode
    from nanoserve.adapters.llama import LLAMA

    model = tiny_model("llama").to(torch.float16)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda module, args, out: out.mul_(0.5)
    )
    fused_decode = FusedDecode(model.model, LLAMA.decoder_layers(model), LLAMA, "triton",
                               residual=False)  # fmt: skip
    try:
        with mode():
            stock = model(ids).logits.float()
            with fused_decode.active(rows=ids.numel(), residual=False):
                fused = model(ids).logits.float()
    finally:
        handle.remove()
    assert fused_decode.counts()["rotary_qkv"] == 1  # layer 1 only
    torch.testing.assert_close(fused, stock, rtol=0, atol=1e-3)


def test_only_transformers_own_attention_forward_without_hooks_rotates_ahead(monkeypatch):
    """A forward set on the attention module or its class (either may write q or k between
    the projections and the rotation) or a hook on a projection keeps the rotation apart.
    Planted: the instance check and the class check dropped from ``_rotates_ahead``: each
    failed."""
    from test_families import tiny_model
    from transformers.models.llama.modeling_llama import LlamaAttention

    from nanoserve.adapters.fused_decode import FusedDecode
    from nanoserve.adapters.llama import LLAMA

    model = tiny_model("llama").to(torch.float16)
    fused_decode = FusedDecode(model.model, LLAMA.decoder_layers(model), LLAMA, "triton")
    group = fused_decode.siblings[0]
    assert group.attention is model.model.layers[0].self_attn and group._rotates_ahead()
    handle = group.linears[2].register_forward_hook(lambda *args: None)
    assert not group._rotates_ahead()
    handle.remove()
    original = LlamaAttention.forward

    def forward(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    group.attention.forward = functools.partial(forward, group.attention)
    assert not group._rotates_ahead()
    del group.attention.forward
    assert group._rotates_ahead()
    monkeypatch.setattr(LlamaAttention, "forward", forward)
    assert not group._rotates_ahead()


@pytest.fixture
def scatters(monkeypatch):
    """The rows of each slot scatter the paged cache launches, in order."""
    import nanoserve.cache.paged_cache as paged_cache

    seen = []
    real_scatter = paged_cache.slot_scatter

    def counted(key, *args, **kwargs):
        seen.append(key.shape[0])
        return real_scatter(key, *args, **kwargs)

    monkeypatch.setattr(paged_cache, "slot_scatter", counted)
    return seen


@NEEDS_INTERPRETER
# mistral: a window over every layer; qwen2-sliding: a grouped cache (windowed and full layers)
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2-sliding"])
def test_decode_steps_take_the_rows_the_launch_stored(name, scatters, monkeypatch):
    """Decode steps whose q/k/v launch rotated ahead also store k and v in the layer's
    pools there, and the cache skips its scatter: logits and tokens bit-equal to the same
    steps with the store off (the scatter writes the same rows), and no scatter launched
    after the prefill. Planted: the store masked off in the kernel (the scatter still
    skipped: the pools keep NaN/zeros): failed; the cache skipping the scatter without
    the store: failed."""
    from test_fused_decode import fp16_model, padded_batch, run

    from nanoserve.adapters.qkv_rotary import QKVRotary

    model = fp16_model(name)
    inputs = padded_batch([7, 3], 7)
    with monkeypatch.context() as off:
        off.setattr(QKVRotary, "store_target", lambda *args: None)
        plain, plain_stats = run(model, inputs)
    assert plain_stats["fused_decode"]["kv_store"] == 0
    plain_scatters, scatters[:] = list(scatters), []
    stored, stats = run(model, inputs)
    layers = model.config.num_hidden_layers
    assert stats["fused_decode"]["kv_store"] == layers
    assert stats["fused_decode"] == {**plain_stats["fused_decode"], "kv_store": layers}
    assert len(plain_scatters) == 6 * layers  # the prefill and five decode steps
    assert len(scatters) == layers  # the prefill's only
    assert torch.equal(stored.sequences, plain.sequences)
    for a, b in zip(stored.logits, plain.logits, strict=True):
        assert torch.equal(a, b)


@NEEDS_INTERPRETER
def test_stored_rows_are_taken_only_as_they_were_stored():
    """``Stored.target_for`` gives the target for the very views, unwritten since, and
    None for another view, a copy, or the rows written in place after the launch.
    Planted: the version check dropped (in place: failed), the view check dropped (the
    copy and the other view: failed)."""
    from nanoserve.adapters.qkv_rotary import Stored, _version
    from nanoserve.kernels.slot_scatter import KVStore

    key = torch.randn(2, KV_HEADS, 1, DIM).half()
    value = torch.randn(2, 1, KV_HEADS * DIM).half().view(2, 1, KV_HEADS, DIM).transpose(1, 2)
    target = KVStore(torch.zeros(1), torch.zeros(1), torch.zeros(1))
    stored = Stored(key, value, target, (_version(key), _version(value)))
    assert stored.target_for(key.view(key.shape), value.transpose(1, 2).transpose(1, 2)) is target
    assert stored.target_for(key.clone(), value) is None
    assert stored.target_for(key, value[:1]) is None
    value.mul_(2)
    assert stored.target_for(key, value) is None


@NEEDS_INTERPRETER
def test_a_continued_cache_stores_in_its_extend_and_decode_steps(scatters, monkeypatch):
    """A returned cache continued with new prompt tokens: the pools exist, so the extend step
    (7 token rows) and the decode steps store their K/V rows in the q/k/v launch and no
    scatter runs; logits and tokens bit-equal to the continuation with the store off."""
    from test_fused_decode import GREEDY, fp16_model

    import nanoserve
    from nanoserve.adapters.decode_graphs import DecodeGraphs
    from nanoserve.adapters.hf_cache import cache_kwarg
    from nanoserve.adapters.qkv_rotary import QKVRotary
    from nanoserve.adapters.step import state_of

    model = fp16_model()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    extra = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    patch = {"block_size": 4, "backend": "triton"}

    def continued():
        nanoserve.patch_model(model, **patch)
        state_of(model).graphs = DecodeGraphs(capture=False)
        try:
            with torch.no_grad():
                first = model.generate(input_ids=ids, max_new_tokens=3, **GREEDY)
                longer = torch.cat([first.sequences, extra], dim=1)
                scatters.clear()
                return model.generate(
                    input_ids=longer, attention_mask=torch.ones_like(longer), max_new_tokens=4,
                    **{cache_kwarg(type(model)): first.past_key_values}, **GREEDY,
                )  # fmt: skip
        finally:
            nanoserve.unpatch_model(model)

    with monkeypatch.context() as off:
        off.setattr(QKVRotary, "store_target", lambda *args: None)
        plain = continued()
    assert scatters  # (the store off: every step scatters)
    stored = continued()
    assert scatters == []
    assert torch.equal(stored.sequences, plain.sequences)
    for a, b in zip(stored.logits, plain.logits, strict=True):
        assert torch.equal(a, b)
