"""A gated MLP of a few rows (a decode step's MLP) in one launch: launcher and reference.

``fused_mlp(x, gate, up, down)`` is ``down(silu(x @ gate.T) * (x @ up.T))`` with each
product, the SiLU and the product rounded to x's dtype where eager PyTorch rounds them, from
float32 accumulation (``fused_mlp_ref``: the same roundings from float64). On a GPU it is one
cooperative launch whose programs meet at a grid barrier between the activation and the down
product (``triton_fused_mlp.py``); elsewhere (Triton's CPU interpreter) the same two phases
run as two launches. Summation order differs from cuBLAS's, so 16-bit outputs can differ
from eager's by a few units in the last place, as ``small_batch_linear``'s do.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from nanoserve.kernels.dispatch import (
    _interpreting,
    pdl_launch,
    refuse_interpreted_bfloat16,
    sm_count,
    use_triton,
)
from nanoserve.kernels.small_batch_linear import fits_offsets, small_batch_linear_ref
from nanoserve.kernels.small_batch_linear import input_problem as linear_problem

MAX_ROWS = 16
# column tiles a program may take, in order of preference where they cost the same
TILE_WIDTHS = (32, 16, 64)
# programs an SM: two keep two tiles' loads in flight, as the separate launches' do
PROGRAMS_PER_SM = 2
MAX_SHARES = 8
# the one launch as a cooperative launch: the driver has every program resident at once or
# refuses the launch, where a plain one could leave programs waiting at the barrier for
# programs that cannot start (it ran as fast as a plain launch: benchmarks/RESULTS.md)
COOPERATIVE = True


class MlpConfig(NamedTuple):
    """Programs, column tiles and K steps of each phase, the down product's K shares, and
    whether both phases run in one launch (a grid barrier between them) or in two."""

    programs: int
    up_n: int
    up_k: int
    down_n: int
    down_k: int
    shares: int
    num_warps: int
    num_stages: int
    one_launch: bool


def fused_mlp_ref(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Reference. x [M, K]; gate, up [N, K]; down [H, N]; one dtype. Returns [M, H] in x's
    dtype: the activation and the output computed in float64, each rounded where eager
    PyTorch rounds."""
    hidden = small_batch_linear_ref(x, [gate, up], gated=True)
    return small_batch_linear_ref(hidden, [down])


def input_problem(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    barrier: torch.Tensor | None = None,
) -> str | None:
    """Why ``fused_mlp`` refuses these arguments (the ValueError's message), or None."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x: expected [M, K] with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}"
    problem = linear_problem(x, [gate, up], gated=True)
    if problem is not None:
        return problem.replace("weights[0]", "gate").replace("weights[1]", "up")
    width = gate.shape[0]
    if down.dim() != 2 or down.shape[1] != width or not down.is_contiguous():
        return (
            f"down: expected a contiguous [H, {width}] tensor, got {tuple(down.shape)} "
            f"(contiguous: {down.is_contiguous()})"
        )
    if down.dtype != x.dtype or down.device != x.device:
        return f"down: dtype/device {down.dtype}/{down.device} differ from x's"
    if not fits_offsets(down):
        return f"down: {tuple(down.shape)} is too large for the kernel's 32-bit offsets"
    if barrier is not None and (
        barrier.dim() != 1 or barrier.numel() < barrier_size(down.shape[0])
        or barrier.dtype != torch.int32 or barrier.device != x.device
        or not barrier.is_contiguous()
    ):  # fmt: skip
        return (
            f"barrier: expected a contiguous int32 tensor of at least "
            f"{barrier_size(down.shape[0])} entries on x's device (new_barrier)"
        )
    return None  # (x's dtype and a meta x: linear_problem's checks above)


def barrier_size(out_width: int) -> int:
    """Entries of a barrier state for outputs of ``out_width`` columns: the grid barrier's
    two, and a counter for each of the narrowest column tiles."""
    return 2 + _cdiv(out_width, min(TILE_WIDTHS))


def new_barrier(device: torch.device, out_width: int) -> torch.Tensor:
    """The barrier state for ``fused_mlp(..., barrier=)`` with a ``down`` of ``out_width``
    rows: int32 zeros, which every launch leaves at zero. Made outside a CUDA-graph capture
    (a captured fill runs only at replay); used by one stream's launches at a time (two
    launches at once on one state would mix their counts)."""
    return torch.zeros(barrier_size(out_width), dtype=torch.int32, device=device)


def fused_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    backend: str = "auto",
    config: MlpConfig | None = None,
    barrier: torch.Tensor | None = None,
    weights_ready: bool = False,
) -> torch.Tensor:
    """``fused_mlp_ref(x, gate, up, down)`` by one Triton launch on a GPU (two in the
    interpreter).

    x [M, K] with 1 <= M <= 16 and unit stride in K; gate and up contiguous [N, K]; down
    contiguous [H, N]; float16, bfloat16 or float32 (float32 exact, no TF32; the interpreter
    refuses bfloat16, whose dot it gets wrong). ``barrier``: the grid barrier's state
    (``new_barrier``), reused across launches; None makes one for this call. ``config``
    overrides the tile choice (benchmarks). ``weights_ready=True`` promises that the kernel
    just before this one on the stream writes no weight (see ``small_batch_linear``).
    Returns a new [M, H] tensor of x's dtype.
    """
    problem = input_problem(x, gate, up, down, barrier)
    if problem is not None:
        raise ValueError(problem)
    rows, k = x.shape
    width, out_width = gate.shape[0], down.shape[0]
    if not use_triton(backend, x) or 0 in (k, width, out_width):
        return fused_mlp_ref(x, gate, up, down)
    refuse_interpreted_bfloat16(x)
    from nanoserve.kernels.triton_fused_mlp import _fused_mlp_kernel

    cfg = config or choose_config(width, out_width, x.device)
    if cfg.down_n < min(TILE_WIDTHS) or cfg.up_n < min(TILE_WIDTHS):
        raise ValueError(f"config: tiles of at least {min(TILE_WIDTHS)} columns (the barrier "
                         "state holds a counter for each such tile of down)")  # fmt: skip
    if cfg.one_launch and (not x.is_cuda or _interpreting()):
        raise ValueError("config: one_launch needs a GPU (the interpreter runs programs in turn)")
    up_tiles, down_tiles = _cdiv(width, cfg.up_n), _cdiv(out_width, cfg.down_n)
    # every share but the last is whole K steps; no share is empty
    k_share = _cdiv(_cdiv(width, cfg.shares), cfg.down_k) * cfg.down_k
    shares = _cdiv(width, k_share)
    hidden = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    out = torch.empty(rows, out_width, dtype=x.dtype, device=x.device)
    partial = out
    if shares > 1:
        partial = torch.empty(shares, 16, out_width, dtype=torch.float32, device=x.device)
    state = barrier if barrier is not None else new_barrier(x.device, out_width)
    launch = pdl_launch(x.device)
    common = dict(
        BLOCK_M=16, UP_N=cfg.up_n, UP_K=cfg.up_k, DOWN_N=cfg.down_n, DOWN_K=cfg.down_k,
        EVEN_UP_K=k % cfg.up_k == 0, EVEN_DOWN_K=width % cfg.down_k == 0,
        FP32=x.dtype == torch.float32, PDL=bool(launch),
        WEIGHTS_FIRST=weights_ready and bool(launch),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )  # fmt: skip
    args = (x, x.stride(0), rows, k, gate, up, hidden, width, down, out, out.stride(0),
            out_width, state, partial, up_tiles, down_tiles, k_share, shares)  # fmt: skip
    items = down_tiles * shares
    if cfg.one_launch:
        one = dict(PHASES=3, launch_cooperative_grid=COOPERATIVE, **common)
        key = (x.device, x.dtype, cfg, tuple(sorted(one.items())))
        resident = _resident.get(key)
        if resident is None:  # (compiled without a launch, its resources read)
            kernel = _fused_mlp_kernel.warmup(*args, grid=(1,), **one)
            resident = _resident[key] = resident_programs(kernel, x.device)
        if resident >= 1:  # (else a program would not fit an SM: two launches)
            programs = min(cfg.programs, resident, max(up_tiles, items))
            _fused_mlp_kernel[(programs,)](*args, **one)
            return out
    for phase, tiles in ((1, up_tiles), (2, items)):
        _fused_mlp_kernel[(min(cfg.programs, tiles),)](*args, PHASES=phase, **common)
    return out


# (device, dtype, config, launch options) -> programs that can be resident at once
_resident: dict[tuple, int] = {}


def resident_programs(kernel, device: torch.device) -> int:
    """Programs of the compiled ``kernel`` that ``device`` holds at once (registers, shared
    memory and threads an SM, times the SMs): the most a cooperative launch may have."""
    _ = kernel.run  # loads the binary, which gives its registers a thread
    warps = kernel.metadata.num_warps
    return sm_count(device) * _per_sm(device.index or 0, kernel.n_regs, kernel.metadata.shared,
                                      warps)  # fmt: skip


@functools.cache
def _per_sm(index: int, registers: int, shared: int, warps: int) -> int:
    props = torch.cuda.get_device_properties(index)
    per_warp = -(-registers * 32 // 256) * 256  # allocated in units of 256
    return min(
        getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps),
        # (1 KiB of each block's shared memory is the system's)
        getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024),
        getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
    )


def _spread(items: int, programs: int) -> float:
    """The busiest program's work over the average's when ``programs`` take ``items`` equal
    items in turn (1.0: all equal)."""
    return _cdiv(items, programs) * programs / items


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_config(width: int, out_width: int, device: torch.device) -> MlpConfig:
    """One launch of ``PROGRAMS_PER_SM`` programs an SM on a GPU (two launches elsewhere):
    the activation's column tiles (``TILE_WIDTHS``' order among equals) and the down
    product's K shares of its narrowest tiles (the fewest among equals, up to
    ``MAX_SHARES``, each at least one K step) that spread the work most evenly."""
    one_launch = device.type == "cuda" and not _interpreting()
    return _config(width, out_width, sm_count(device), one_launch)


@functools.cache  # (a decode step's eager forwards ask at every MLP)
def _config(width: int, out_width: int, sms: int, one_launch: bool) -> MlpConfig:
    programs = PROGRAMS_PER_SM * sms
    up_n = min(TILE_WIDTHS, key=lambda n: _spread(_cdiv(width, n), programs))
    down_n, down_k = min(TILE_WIDTHS), 256
    most = 1
    while most < MAX_SHARES and width >= 2 * most * down_k:
        most *= 2
    counts = [1 << i for i in range(most.bit_length())]
    shares = min(counts, key=lambda s: _spread(_cdiv(out_width, down_n) * s, programs))
    return MlpConfig(
        programs=programs,
        up_n=up_n,
        up_k=128,
        down_n=down_n,
        down_k=down_k,
        shares=shares,
        num_warps=4,
        num_stages=4,
        one_launch=one_launch,
    )


# one launch pays where the weights take long enough to read that the barrier's cost is
# small beside them, and where every program gets about the same work (the separate
# launches' programs, which the GPU schedules as SMs free up, balance themselves)
MIN_PAYING_BYTES = 32 << 20
MOST_SPREAD = 1.1


def one_launch_pays(k: int, width: int, out_width: int, dtype: torch.dtype,
                    device: torch.device) -> bool:  # fmt: skip
    """True when ``fused_mlp``'s one launch beats two launches (see benchmarks/RESULTS.md)
    for gate and up [width, k] and down [out_width, width] of ``dtype`` on ``device``."""
    cfg = choose_config(width, out_width, device)
    weight_bytes = (2 * width * k + out_width * width) * dtype.itemsize
    return (
        weight_bytes >= MIN_PAYING_BYTES
        and _spread(_cdiv(width, cfg.up_n), cfg.programs) <= MOST_SPREAD
        and _spread(_cdiv(out_width, cfg.down_n) * cfg.shares, cfg.programs) <= MOST_SPREAD
    )
