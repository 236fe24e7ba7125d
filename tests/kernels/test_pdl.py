"""Programmatic dependent launch: a kernel launched with ``launch_pdl`` starts before the
kernel ahead of it has finished, so it must open with ``pdl_enter`` (its ``PDL`` constexpr)
or it would read that kernel's outputs early. Every launcher of a decode step's kernels is
run with the kernels replaced by recorders, with PDL supported and not."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import make_paged_kv, needs_interpreter

import nanoserve.kernels.dispatch as dispatch
import nanoserve.kernels.triton_decode as triton_decode
import nanoserve.kernels.triton_linear as triton_linear
import nanoserve.kernels.triton_rms_norm as triton_rms_norm
import nanoserve.kernels.triton_rotary as triton_rotary
import nanoserve.kernels.triton_scatter as triton_scatter
from nanoserve.kernels.rms_norm import rms_norm
from nanoserve.kernels.rotary import apply_rotary
from nanoserve.kernels.small_batch_linear import LinearConfig, small_batch_linear

KERNELS = [
    (triton_rms_norm, "_rms_norm_kernel"),
    (triton_rotary, "_rotary_kernel"),
    (triton_scatter, "_slot_scatter_kernel"),
    (triton_linear, "_linear_kernel"),
    (triton_linear, "_sum_shares_kernel"),
    (triton_decode, "_decode_kernel"),
    (triton_decode, "_reduce_kernel"),
    (triton_decode, "_merge_items_kernel"),
]


class _Recorder:
    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, kwargs))


def _launch_every_kernel() -> None:
    half = torch.float16
    x = torch.randn(3, 64).to(half)
    rms_norm(x, torch.ones(64, dtype=half), 1e-6, backend="triton")
    q, k = torch.randn(1, 4, 3, 16).to(half), torch.randn(1, 2, 3, 16).to(half)
    cos, sin = torch.randn(1, 3, 16).to(half), torch.randn(1, 3, 16).to(half)
    apply_rotary(q, k, cos, sin, backend="triton")
    key_cache, value_cache, tables, seq_lens = make_paged_kv([100, 7], 2, 64, 16, half)
    new = torch.randn(2, 2, 64).to(half)
    triton_scatter.slot_scatter_triton(
        new, new, key_cache, value_cache, torch.tensor([3, 40], dtype=torch.int32)
    )
    weights = [torch.randn(32, 64).to(half)]
    split = LinearConfig(block_n=16, block_k=32, split=2, num_warps=4, num_stages=2)
    small_batch_linear(x, weights, backend="triton", config=split)
    query = torch.randn(2, 8, 64).to(half)
    # fixed splits + merge, one run, balanced + merge
    for launch in ({"num_splits": 4}, {"num_splits": 1}, {"work_items": 8}):
        triton_decode.paged_decode_attention_triton(
            query, key_cache, value_cache, tables, seq_lens, scale=0.125,
            sliding_window=None, softcap=None, **launch,
        )  # fmt: skip


@needs_interpreter
@pytest.mark.parametrize("supported", [True, False])
def test_a_kernel_launched_with_pdl_waits_on_the_device(monkeypatch, supported):
    launches = []
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _Recorder(name, launches))
    monkeypatch.setattr(dispatch, "supports_pdl", lambda device: supported)
    _launch_every_kernel()
    names = {name for name, _ in launches}
    assert names == {name for _, name in KERNELS}, names
    for name, kwargs in launches:
        assert kwargs.get("launch_pdl", False) is supported, (name, kwargs.get("launch_pdl"))
        assert kwargs["PDL"] is supported, (name, kwargs["PDL"])


def test_the_switch_turns_pdl_off(monkeypatch):
    """``NANOSERVE_PDL=0`` (the benchmarks' A/B) launches nothing with PDL."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "_capability_major", lambda index: 9)
    cuda = torch.device("cuda", 0)
    assert dispatch.pdl_launch(cuda) == {"launch_pdl": True}
    monkeypatch.setenv("NANOSERVE_PDL", "0")
    assert dispatch.pdl_launch(cuda) == {}


@needs_interpreter
@pytest.mark.parametrize("supported", [True, False])
def test_weights_are_read_before_the_wait_only_when_the_caller_says_they_are_ready(
    monkeypatch, supported
):
    """A linear program loads weight tiles before its PDL wait only with ``weights_ready``
    (else the kernel ahead may still be writing them) and only under PDL. Planted: ready by
    default: failed."""
    launches = []
    monkeypatch.setattr(triton_linear, "_linear_kernel", _Recorder("linear", launches))
    monkeypatch.setattr(dispatch, "supports_pdl", lambda device: supported)
    x, weights = torch.randn(3, 64).half(), [torch.randn(32, 64).half()]
    small_batch_linear(x, weights, backend="triton")
    small_batch_linear(x, weights, backend="triton", weights_ready=True)
    assert [kwargs["WEIGHTS_FIRST"] for _, kwargs in launches] == [False, supported]
