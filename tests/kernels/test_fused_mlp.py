"""The gated MLP in one launch (``fused_mlp``): Triton (interpreter, its two-launch form)
against the float64 / float32 reference, programs taking several tiles, bad input."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter, rel_err

from nanoserve.kernels.fused_mlp import (
    MlpConfig,
    choose_config,
    fused_mlp,
    fused_mlp_ref,
    new_barrier,
    one_launch_pays,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# three programs over more items than that, K steps shorter than K, down's K in shares
SMALL = MlpConfig(programs=3, up_n=16, up_k=32, down_n=16, down_k=32, shares=3, num_warps=4,
                  num_stages=2, one_launch=False)  # fmt: skip


def _inputs(rows, k, n, h, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    gate, up = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for _ in range(2)]
    down = (torch.randn(h, n, generator=gen) / n**0.5).to(dtype)
    return x, gate, up, down


def _exact(x, gate, up, down):
    """float64 with the activation rounded to x's dtype, as the kernel's h is."""
    x, gate, up = x.double(), gate.double(), up.double()
    hidden = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)).to(down.dtype)
    return hidden.double() @ down.double().T


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("rows", "k", "n", "h", "config"),
    [
        (1, 64, 96, 48, None),  # one row, the launcher's tiles
        (5, 80, 200, 72, SMALL),  # K, N and H off the tiles; programs take several tiles
        (16, 128, 64, 130, SMALL),  # the most rows; H one past a tile multiple
        (3, 15, 17, 1, None),  # K and N under one tile, one output column
        (7, 96, 48, 33, MlpConfig(2, 32, 64, 16, 64, 1, 4, 3, False)),  # K, N under the K step
        (2, 64, 300, 40, SMALL._replace(shares=8)),  # the last of 5 shares ends past N
    ],
)
def test_matches_reference(rows, k, n, h, config, dtype):
    """Planted: the down tile read from the next program's columns, a program's next tile one
    program on instead of all of them, the activation without silu: each failed."""
    x, gate, up, down = _inputs(rows, k, n, h, dtype, seed=rows * k + n)
    out = fused_mlp(x, gate, up, down, backend="triton", config=config)
    ref = fused_mlp_ref(x, gate, up, down)
    assert out.shape == (rows, h) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(out, _exact(x, gate, up, down)) < TOLERANCE[dtype]


def test_reference_is_the_two_eager_projections():
    """The reference rounds where eager Llama's MLP does: the products, silu, the product,
    then down's product (float64 sums, so only the last bit can differ from float32 eager)."""
    x, gate, up, down = _inputs(4, 64, 96, 40, torch.float32, seed=1)
    eager = torch.nn.functional.linear(torch.nn.functional.silu(x @ gate.T) * (x @ up.T), down)
    torch.testing.assert_close(fused_mlp_ref(x, gate, up, down), eager, rtol=1e-5, atol=1e-6)


def test_auto_on_cpu_runs_the_reference(forbid_triton):
    x, gate, up, down = _inputs(2, 32, 48, 16, torch.float32, seed=2)
    assert torch.equal(fused_mlp(x, gate, up, down), fused_mlp_ref(x, gate, up, down))


@needs_interpreter
def test_one_launch_is_refused_where_programs_run_in_turn():
    x, gate, up, down = _inputs(2, 32, 48, 16, torch.float16, seed=3)
    with pytest.raises(ValueError, match="config: one_launch"):
        fused_mlp(x, gate, up, down, backend="triton", config=SMALL._replace(one_launch=True))


def _bad(**change):
    x, gate, up, down = _inputs(2, 32, 48, 16, torch.float32, seed=4)
    args = dict(x=x, gate=gate, up=up, down=down)
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (_bad(x=torch.randn(17, 32)), r"x: expected \[M, K\] with 1 <= M <= 16"),
        (_bad(x=torch.randn(2, 32).to(torch.int32)), "x: expected float16"),
        (_bad(up=torch.randn(40, 32)), "gated=True takes a gate and an up weight"),
        (_bad(gate=torch.randn(48, 31), up=torch.randn(48, 31)), r"gate: expected .*\[N, 32\]"),
        (_bad(down=torch.randn(16, 47)), r"down: expected a contiguous \[H, 48\]"),
        (_bad(down=torch.randn(48, 16).T), r"down: expected a contiguous \[H, 48\]"),
        (_bad(down=torch.randn(16, 48).half()), "down: dtype/device"),
        (_bad(barrier=torch.zeros(3)), "barrier: expected a contiguous int32 tensor of at least 3"),
        (_bad(barrier=torch.zeros(2, dtype=torch.int32)), "barrier: expected a contiguous int32"),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fused_mlp(**kwargs)


@needs_interpreter
def test_the_barrier_state_is_left_at_zero():
    """Two launches on one state (the counters per tile are kept between launches): the
    second computes as the first, and every count is back at 0."""
    x, gate, up, down = _inputs(3, 64, 200, 72, torch.float16, seed=5)
    state = new_barrier(torch.device("cpu"), 72)
    assert state.dtype == torch.int32 and state.shape == (2 + 72 // 16 + 1,)
    first = fused_mlp(x, gate, up, down, backend="triton", config=SMALL, barrier=state)
    assert not state.any()
    again = fused_mlp(x, gate, up, down, backend="triton", config=SMALL, barrier=state)
    assert torch.equal(first, again) and not state.any()


def test_config_spreads_the_work_evenly(monkeypatch):
    monkeypatch.setattr("nanoserve.kernels.fused_mlp.sm_count", lambda device: 132)
    cfg = choose_config(8192, 2048, torch.device("cpu"))  # Llama-3.2-1B
    # 264 programs; gate / up: 256 tiles of 32, one a program (512 of 16 and 128 of 64
    # spread as evenly: the first preferred); down: 128 tiles of 16 columns in 2 shares, one
    # item a program (4 shares, two a program, spread as evenly: the fewer preferred)
    assert (cfg.programs, cfg.up_n, cfg.down_n, cfg.shares) == (264, 32, 16, 2)
    assert not cfg.one_launch  # the interpreter's programs run in turn
    cfg = choose_config(1536, 576, torch.device("cpu"))  # SmolLM2-135M
    # 96 tiles of 16 (48 of 32 leave more programs idle); down: 36 tiles in 4 shares (8
    # would leave a share under one K step of 256)
    assert (cfg.up_n, cfg.down_n, cfg.shares) == (16, 16, 4)


@pytest.mark.parametrize(
    ("k", "width", "out_width", "pays"),
    [
        (2048, 8192, 2048, True),  # Llama-3.2-1B: 100 MB, one item a program in each phase
        (3072, 8192, 3072, True),  # Llama-3.2-3B
        (576, 1536, 576, False),  # SmolLM2-135M: 5 MB, the barrier's cost not paid back
        (4096, 14336, 4096, False),  # Llama-3.1-8B: 896 / 448 / 224 tiles over 264 programs
    ],
)
def test_one_launch_pays_for_large_evenly_spread_weights(k, width, out_width, pays, monkeypatch):
    monkeypatch.setattr("nanoserve.kernels.fused_mlp.sm_count", lambda device: 132)
    assert one_launch_pays(k, width, out_width, torch.bfloat16, torch.device("cpu")) is pays
