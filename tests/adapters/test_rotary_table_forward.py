"""The rotary embedding module's stand-in (``rotary_tables.py``): the tables in one launch
where the formula is the module's, and the module's own forward, bit for bit, wherever it
is not (CPU, Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from helpers import NEEDS_INTERPRETER
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanoserve.adapters.rotary_tables import rotary_table_forward, rotary_table_module

CLASSES = ("LlamaRotaryEmbedding",)


def _module(rope_type: str = "default") -> LlamaRotaryEmbedding:
    rope = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "dynamic":
        rope["factor"] = 2.0
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=rope)
    return LlamaRotaryEmbedding(config)


def _stand_in(module):
    calls = []
    return rotary_table_forward(module, "triton", lambda: calls.append(1)), calls


def _positions(rows=3, seq=2):
    return torch.randint(0, 5000, (rows, seq), generator=torch.Generator().manual_seed(1))


@NEEDS_INTERPRETER
def test_fused_tables_follow_the_module():
    module = _module()
    assert rotary_table_module(module, CLASSES)
    forward, calls = _stand_in(module)
    x = torch.zeros(3, 2, 4, dtype=torch.float16)
    cos, sin = forward(x, _positions())
    stock_cos, stock_sin = module(x, _positions())
    assert calls == [1]
    assert cos.dtype == stock_cos.dtype and cos.shape == stock_cos.shape
    # numpy's float32 cos and sin in the interpreter: the same to a unit of float16
    assert torch.allclose(cos.float(), stock_cos.float(), rtol=0, atol=1e-3)
    assert torch.allclose(sin.float(), stock_sin.float(), rtol=0, atol=1e-3)


def _dynamic():
    return _module("dynamic"), {}, torch.float16


def _layer_type():
    return _module(), {"layer_type": None}, torch.float16


def _float32_input():
    return _module(), {}, torch.float32


@NEEDS_INTERPRETER
@pytest.mark.parametrize("case", [_dynamic, _layer_type, _float32_input])
def test_what_the_formula_does_not_cover_runs_the_module(case):
    """Planted: the stand-in fused whatever it was given: the dynamic type, the keyword and
    the float32 input each failed (dynamic RoPE moves its frequencies past the trained
    length; the kernel would not)."""
    module, kwargs, dtype = case()
    forward, calls = _stand_in(module)
    x = torch.zeros(3, 2, 4, dtype=dtype)
    positions = _positions() * 3  # past the dynamic type's trained length
    cos, sin = forward(x, positions, **kwargs)
    reference = _module(module.rope_type)
    stock_cos, stock_sin = reference(x, positions, **kwargs)
    assert calls == []
    assert torch.equal(cos, stock_cos) and torch.equal(sin, stock_sin)


def _same(tables, stock) -> bool:
    return all(torch.equal(a, b) for a, b in zip(tables, stock, strict=True))


@NEEDS_INTERPRETER
def test_float_positions_tf32_and_a_replaced_class_forward_run_the_module(monkeypatch):
    module = _module()
    forward, calls = _stand_in(module)
    x = torch.zeros(3, 2, 4, dtype=torch.float16)
    positions = _positions()
    assert _same(forward(x, positions.float()), module(x, positions.float()))
    # (transformers 5.17 forms the angles as a matrix product, which TF32 would round)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert _same(forward(x, positions), module(x, positions))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before

    original = LlamaRotaryEmbedding.forward

    def halved(self, x, position_ids):
        cos, sin = original(self, x, position_ids)
        return cos / 2, sin / 2

    monkeypatch.setattr(LlamaRotaryEmbedding, "forward", halved)
    assert not rotary_table_module(module, CLASSES)
    cos, _ = forward(x, positions)
    assert torch.equal(cos, module(x, positions)[0])
    assert calls == []


@NEEDS_INTERPRETER
def test_tf32_set_through_fp32_precision_runs_the_module():
    """torch refuses to read ``allow_tf32`` once ``matmul.fp32_precision`` says TF32: the
    stand-in must fall back, not raise (found by a review: every fused step raised).
    Planted: the flag read unguarded: raised."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend float32 precision")
    module = _module()
    forward, calls = _stand_in(module)
    x = torch.zeros(3, 2, 4, dtype=torch.float16)
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        assert _same(forward(x, _positions()), module(x, _positions()))
    finally:
        matmul.fp32_precision = before
    assert calls == []
