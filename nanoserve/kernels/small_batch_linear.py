"""Linear layers of a few rows (a decode step's projections): kernel launcher and reference.

``small_batch_linear(x, weights)`` is ``torch.cat([x @ w.T + b for w, b in ...], -1)`` for
one to three weights that read the same x (fused: one launch), and with ``gated=True``
``silu(x @ gate.T) * (x @ up.T)``; products accumulate in float32 and each output is
rounded to x's dtype where eager PyTorch rounds it (the layer's output, silu's output, the
product). Summation order differs from cuBLAS's, so 16-bit outputs can differ from
``torch.nn.functional.linear`` in the last bit, as they differ between cuBLAS's own kernels
(a gated output by a few units: silu and the product carry gate's or up's last bit).

``small_batch_linear_rotary`` runs a layer's q, k and v projections and writes, beside them,
q and k with Llama's rotary embedding applied (``rotary.apply_rotary``'s bits), so that a
decode step needs no launch of its own for the rotation; given a layer's K/V pools and the
rows' slots (``KVStore``) it stores k rotated and v there too, which spares the step's slot
scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from nanoserve.kernels.dispatch import (
    float_input_problem,
    meta_problem,
    pdl_launch,
    refuse_interpreted_bfloat16,
    sm_count,
    use_triton,
)
from nanoserve.kernels.rotary import apply_rotary
from nanoserve.kernels.slot_scatter import KVStore, slot_scatter
from nanoserve.kernels.validation import check_kv_pools, check_slot_mapping, check_slot_values

MAX_ROWS = 64
MAX_WEIGHTS = 3
_MAX_OFFSET = 2**31  # a weight's element offsets are int32 in the kernel


class LinearConfig(NamedTuple):
    """Tile and launch shape: output columns and K per step of a program, K shares."""

    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int


def small_batch_linear_ref(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    gated: bool = False,
) -> torch.Tensor:
    """Reference. x [M, K]; weights [N_i, K]; biases [N_i] or None; same dtype throughout.

    Returns [M, sum N_i] in x.dtype (gated: [M, N], from exactly two weights of equal N),
    computed in float64 (no TF32 on any device) and rounded once per output.
    """
    compute = torch.float64
    biases = list(biases) if biases is not None else [None] * len(weights)
    outs = []
    for w, b in zip(weights, biases, strict=True):
        y = x.to(compute) @ w.to(compute).T
        if b is not None:
            y = y + b.to(compute)
        outs.append(y.to(x.dtype))
    if not gated:
        return torch.cat(outs, dim=-1)
    g, u = outs
    act = torch.nn.functional.silu(g.to(compute)).to(x.dtype)
    return (act.to(compute) * u.to(compute)).to(x.dtype)


def small_batch_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    gated: bool = False,
    backend: str = "auto",
    config: LinearConfig | None = None,
    weights_ready: bool = False,
) -> torch.Tensor:
    """``small_batch_linear_ref``'s result by one Triton launch (two with K split in shares).

    x [M, K] with 1 <= M <= 64 and unit stride in K; weights 1 to 3 contiguous [N_i, K]
    (gated: gate and up, equal shapes); float16, bfloat16 or float32 (float32 exact, no
    TF32; in Triton's CPU interpreter, whose bfloat16 dot is wrong, backend="triton" refuses
    bfloat16). ``config`` overrides the tile choice (benchmarks). ``weights_ready=True``
    promises that the kernel just before this one on the stream writes no weight (a model's
    parameters in a decode step; nanoserve's kernels let the next one start only after their
    own wait, so no earlier kernel still runs): launched with programmatic dependent launch,
    each program then loads its first weight tiles before it waits for that kernel.
    Returns a new [M, sum N_i] tensor of x's dtype (gated [M, N]).
    """
    weights = list(weights)
    biases = list(biases) if biases is not None else [None] * len(weights)
    problem = input_problem(x, weights, biases, gated)
    if problem is not None:
        raise ValueError(problem)
    rows, k = x.shape
    sizes = [w.shape[0] for w in weights]
    if not use_triton(backend, x) or k == 0:  # (K = 0: the bias alone, no tile to load)
        return small_batch_linear_ref(x, weights, biases, gated=gated)
    refuse_interpreted_bfloat16(x)
    cfg = config or choose_config(rows, k, sizes, gated, x.device)
    return _launch(x, weights, biases, gated, cfg, weights_ready)[0]


def _shares(k: int, cfg: LinearConfig) -> tuple[int, int]:
    """(K a share covers, shares): every share but the last is whole ``block_k`` tiles."""
    share = -(-k // cfg.split)
    share = -(-share // cfg.block_k) * cfg.block_k
    return share, -(-k // share)


def _launch(x, weights, biases, gated: bool, cfg: LinearConfig, weights_ready: bool,
            cos=None, sin=None, kv_store=None) -> tuple:  # fmt: skip
    """(out,) or with ``cos`` and ``sin`` (q, k and v weights, K in one share) (out, q
    rotated [M, N_q], k rotated [M, N_k]): the kernel's launches for checked arguments; with
    the rotation q and k's tiles are halves of heads, and ``kv_store`` (key_pool,
    value_pool, slot_mapping) takes k rotated and v into the pools as well."""
    from nanoserve.kernels.triton_linear import _linear_kernel, _sum_shares_kernel

    rows, k = x.shape
    sizes = [w.shape[0] for w in weights]
    width = sizes[0] if gated else sum(sizes)
    block_m = row_block(rows)
    rotary = cos is not None
    half = cos.shape[-1] // 2 if rotary else 1
    if rotary:  # a head's columns in tiles of two matching halves
        per_head = -(-half // (cfg.block_n // 2))
        heads = [n // (2 * half) for n in sizes[:2]]
        tiles = [h * per_head for h in heads] + [-(-sizes[2] // cfg.block_n)]
    else:
        tiles = [-(-n // cfg.block_n) for n in (sizes[:1] if gated else sizes)]
    share, split = _shares(k, cfg)
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    rot_q = rot_k = cos_ = sin_ = out
    if rotary:
        rot_q = torch.empty(rows, sizes[0], dtype=x.dtype, device=x.device)
        rot_k = torch.empty(rows, sizes[1], dtype=x.dtype, device=x.device)
        cos_, sin_ = cos, sin
    key_pool = value_pool = slot_mapping = out  # (unused without the store)
    if kv_store is not None:
        key_pool, value_pool, slot_mapping = kv_store
        slot_mapping = slot_mapping.contiguous()  # (the kernel reads it at unit stride)
    partial = out
    if split > 1:
        partial = torch.empty(split, block_m, 2 * width if gated else width,
                              dtype=torch.float32, device=x.device)  # fmt: skip
    pad = [weights[0]] * (MAX_WEIGHTS - len(weights))
    w0, w1, w2 = weights + pad
    b0, b1, b2 = [b if b is not None else weights[0] for b in biases + [None] * len(pad)]
    n0, n1, n2 = sizes + [0] * len(pad)
    has_bias = biases[0] is not None
    fp32 = x.dtype == torch.float32
    launch = pdl_launch(x.device)
    _linear_kernel[(sum(tiles), split)](
        x, x.stride(0), rows, k,
        w0, w1, w2, b0, b1, b2, n0, n1, n2,
        tiles[0], tiles[1] if len(tiles) > 1 else 0,
        out, out.stride(0), partial, share,
        rot_q, rot_k, rot_q.stride(0), rot_k.stride(0),
        cos_, cos_.stride(0), sin_, sin_.stride(0), half,
        key_pool, value_pool, slot_mapping,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=split, GATED=gated, HAS_BIAS=has_bias, EVEN_K=k % cfg.block_k == 0,
        FP32=fp32, PDL=bool(launch), WEIGHTS_FIRST=weights_ready and bool(launch),
        ROTARY=rotary, STORE_KV=kv_store is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # (with the rotation: a product fused into its sum would skip eager's rounding)
        **({"enable_fp_fusion": False} if rotary else {}), **launch,
    )  # fmt: skip
    if split > 1:
        sum_block = 64
        _sum_shares_kernel[(-(-width // sum_block),)](
            partial, out, out.stride(0), rows, b0, b1, b2, n0, n1,
            width=width, BLOCK_M=block_m, BLOCK_N=sum_block,
            SPLIT=split, GATED=gated, HAS_BIAS=has_bias, PDL=bool(launch),
            num_warps=4, **launch,
        )  # fmt: skip
    return (out, rot_q, rot_k) if rotary else (out,)


def small_batch_linear_rotary_ref(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: (``small_batch_linear_ref(x, weights, biases)`` [M, N_q + N_k + N_v], its
    q [M, N_q] and k [M, N_k] with eager's rotary embedding applied); weights q, k, v; cos
    and sin [M, D], each row's angles. ``kv_store``: k rotated and v are also written to
    their slots of its pools, as ``slot_scatter_ref`` writes rows."""
    out = small_batch_linear_ref(x, weights, biases)
    q_rot, k_rot = _rotated(out, weights, cos, sin)
    if kv_store is not None:
        _scatter(out, k_rot, kv_store, "torch")
    return out, q_rot, k_rot


def _scatter(out: torch.Tensor, k_rot: torch.Tensor, kv_store: KVStore, backend: str) -> None:
    """k rotated [M, N_k] and out's v columns to ``kv_store``'s pools by ``slot_scatter``."""
    heads, dim = kv_store.key_pool.shape[2:]
    rows = out.shape[0]
    value = out[:, out.shape[1] - heads * dim :].reshape(rows, heads, dim)
    slot_scatter(k_rot.view(rows, heads, dim), value, kv_store.key_pool, kv_store.value_pool,
                 kv_store.slot_mapping, check=False, backend=backend)  # fmt: skip


def _rotated(out, weights, cos, sin, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """out's q [M, N_q] and k [M, N_k] rotated by ``apply_rotary`` on ``backend``."""
    rows, dim = cos.shape
    n_q, n_k = weights[0].shape[0], weights[1].shape[0]
    q = out[:, :n_q].view(rows, 1, n_q // dim, dim).transpose(1, 2)
    k = out[:, n_q : n_q + n_k].view(rows, 1, n_k // dim, dim).transpose(1, 2)
    q, k = apply_rotary(q, k, cos.view(rows, 1, dim), sin.view(rows, 1, dim), backend=backend)
    return q.reshape(rows, n_q), k.reshape(rows, n_k)


def small_batch_linear_rotary(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
    config: LinearConfig | None = None,
    weights_ready: bool = False,
    kv_store: KVStore | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``small_batch_linear_rotary_ref``'s result: (q, k and v's outputs [M, N_q + N_k +
    N_v], q rotated [M, N_q], k rotated [M, N_k]), new tensors of x's dtype.

    x and the weights as ``small_batch_linear`` takes three (q, k, v; N_q and N_k whole heads
    of D); cos and sin [M, D] with unit stride in D, x's dtype and device. Where K runs in one
    share the rotation is the projection's epilogue (one launch); else, or on the reference
    backend, it follows as ``apply_rotary`` computes it. The rotated outputs are bit-equal
    to eager's rotary embedding of the first output's q and k. ``kv_store`` (a ``KVStore``):
    k rotated and v are also written to their slots of its pools, in the same launch where
    the rotation is (else by ``slot_scatter``); ``check=False`` skips reading its slots
    (in range, none twice: a sync) for callers that built them, and CUDA-graph capture.
    """
    weights = list(weights)
    biases = list(biases) if biases is not None else [None] * len(weights)
    problem = input_problem(x, weights, biases) or rotary_problem(x, weights, cos, sin)
    if problem is None and kv_store is not None:
        problem = kv_store_problem(x, weights, cos, kv_store, check)
    if problem is not None:
        raise ValueError(problem)
    rows, k = x.shape
    if not use_triton(backend, x) or k == 0:  # (as small_batch_linear: the reference)
        out = small_batch_linear_ref(x, weights, biases)
        return _rotated_and_stored(out, weights, cos, sin, kv_store, backend)
    refuse_interpreted_bfloat16(x)
    cfg = config or choose_config(rows, k, [w.shape[0] for w in weights], False, x.device)
    if _shares(k, cfg)[1] > 1:
        out = _launch(x, weights, biases, False, cfg, weights_ready)[0]
        return _rotated_and_stored(out, weights, cos, sin, kv_store, backend)
    return _launch(x, weights, biases, False, cfg, weights_ready, cos, sin, kv_store)


def _rotated_and_stored(out, weights, cos, sin, kv_store, backend) -> tuple:
    """(out, q rotated, k rotated) by their own launches, k and v stored by ``slot_scatter``."""
    q_rot, k_rot = _rotated(out, weights, cos, sin, backend)
    if kv_store is not None:
        _scatter(out, k_rot, kv_store, backend)
    return out, q_rot, k_rot


def kv_store_problem(x, weights, cos, kv_store, check: bool = True) -> str | None:
    """Why ``small_batch_linear_rotary`` refuses ``kv_store`` for these arguments, or None;
    ``check`` also reads the slots (in range, none twice: a sync)."""
    if not isinstance(kv_store, KVStore):
        return f"kv_store: expected a KVStore, got {type(kv_store).__name__}"
    key_pool, value_pool, slot_mapping = kv_store
    try:
        check_kv_pools(key_pool, value_pool)
    except ValueError as error:
        return f"kv_store: {error}"
    blocks, block_size, heads, dim = key_pool.shape
    if key_pool.dtype != x.dtype or key_pool.device != x.device:
        return (
            f"kv_store: pools of {key_pool.dtype} on {key_pool.device}; the rows are stored "
            f"unconverted, so the pools must be x's dtype and device ({x.dtype} on {x.device})"
        )
    if dim != cos.shape[1] or any(w.shape[0] != heads * dim for w in weights[1:]):
        return (
            f"kv_store: pools of [.., {heads}, {dim}] do not hold k and v's "
            f"{weights[1].shape[0]} / {weights[2].shape[0]} outputs as heads of {cos.shape[1]}"
        )
    try:
        check_slot_mapping(slot_mapping, x.shape[0], x.device)
        if check:
            check_slot_values(slot_mapping, blocks * block_size)
    except ValueError as error:
        return f"kv_store: {error}"
    return None


def rotary_problem(x, weights, cos, sin) -> str | None:
    """Why ``small_batch_linear_rotary`` refuses these cos and sin (or weights), or None."""
    if len(weights) != 3:
        return f"weights: expected q, k and v, got {len(weights)}"
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != x.shape[0]:
            return f"{name}: expected [{x.shape[0]}, D], got {getattr(t, 'shape', t)}"
        if t.stride(1) != 1 or t.dtype != x.dtype or t.device != x.device:
            return f"{name}: expected unit stride in D and x's dtype and device"
    dim = cos.shape[1]
    if sin.shape != cos.shape or dim < 2 or dim % 2:
        return f"cos: expected an even D of at least 2, like sin's, got {tuple(cos.shape)}"
    for i in (0, 1):
        if weights[i].shape[0] % dim:
            return f"weights[{i}]: {weights[i].shape[0]} outputs are not whole heads of {dim}"
    return None


def row_block(rows: int) -> int:
    """Rows a program holds: 16 (the matrix unit's least), 32 or 64."""
    return max(16, 1 << (rows - 1).bit_length())


def choose_config(
    rows: int, k: int, sizes: Sequence[int], gated: bool, device: torch.device
) -> LinearConfig:
    """Tiles of 32 columns (64 for wide outputs); when the tiles fill under half of the SMs,
    K is split into up to 4 shares of at least 2,048 (fewer shares would not pay for the
    second pass), so that every SM streams weights. Past 16 rows the x tile grows with the
    rows: K steps of 128 and three stages keep the pipeline's shared memory in bounds."""
    wide = sizes[0] >= 12288 if gated else sum(sizes) >= 4096
    block_n = 64 if wide else 32
    tiles = -(-sizes[0] // block_n) if gated else sum(-(-n // block_n) for n in sizes)
    split, sms = 1, sm_count(device)
    if not gated and tiles < sms // 2:
        while split < 4 and tiles * split < 2 * sms and k // (2 * split) >= 2048:
            split *= 2
    if row_block(rows) > 16:
        return LinearConfig(block_n, 128, split, num_warps=4, num_stages=3)
    block_k = 128 if gated or split > 1 else 256
    return LinearConfig(block_n, block_k, split, num_warps=4, num_stages=4)


def fits_offsets(weight: torch.Tensor) -> bool:
    """True when every element offset a program computes in ``weight`` [N, K] (its last tile
    of columns included) fits in 32 bits."""
    return (weight.shape[0] + 64) * weight.shape[1] < _MAX_OFFSET


def input_problem(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    gated: bool = False,
) -> str | None:
    """Why ``small_batch_linear`` refuses these arguments (the ValueError's message), or None
    when it takes them (callers that fall back to torch ask first)."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return f"x: expected [M, K] with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}"
    if x.stride(1) != 1:
        return "x: the last dimension must have unit stride"
    if (problem := float_input_problem("x", x)) is not None:
        return problem
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        return f"weights: expected 1 to {MAX_WEIGHTS}, got {len(weights)}"
    if gated and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        return "weights: gated=True takes a gate and an up weight of equal shape"
    if len(biases) != len(weights):
        return f"biases: expected {len(weights)} entries, got {len(biases)}"
    if len({b is None for b in biases}) > 1:
        return "biases: give a bias for every weight or for none"
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != x.shape[1] or not w.is_contiguous():
            return (
                f"weights[{i}]: expected a contiguous [N, {x.shape[1]}] tensor, got "
                f"{tuple(w.shape)} (contiguous: {w.is_contiguous()})"
            )
        if not fits_offsets(w):
            return f"weights[{i}]: {tuple(w.shape)} is too large for the kernel's 32-bit offsets"
        if w.dtype != x.dtype or w.device != x.device:
            return f"weights[{i}]: dtype/device {w.dtype}/{w.device} differ from x's"
        b = biases[i]
        if b is not None and (
            b.shape != (w.shape[0],) or (b.dtype, b.device) != (x.dtype, x.device)
            or not b.is_contiguous()
        ):  # fmt: skip
            return (
                f"biases[{i}]: expected a contiguous [{w.shape[0]}] tensor of x's dtype and device"
            )
    return meta_problem("x", x)
