"""``QKVRotary``: the rotation the q/k/v launch computed is handed out only for exactly the
views it rotated, unchanged, with the very tables it used, once (CPU, Triton's
interpreter)."""

from __future__ import annotations

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
