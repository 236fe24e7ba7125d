"""Argument checks shared by every kernel and its reference.

Each check raises ``ValueError`` naming the offending argument, before anything is launched.
The shape/dtype/device checks never touch device memory; the value checks (block ids, lengths)
read the metadata on the host and therefore synchronise, which is why launchers skip them when
the caller passes ``check=False`` after validating its metadata once.
"""

from __future__ import annotations

import math
import numbers

import torch

from nanoserve.kernels.dispatch import FLOAT_DTYPES, meta_problem
from nanoserve.kernels.quant import (
    INT8_DTYPE,
    INT8_K_GROUP,
    INT8_SCALE_DTYPE,
    QUANTIZED_DTYPES,
    int8_scale_shape,
)

# What the kernels compute in when the pools hold FP8 or INT8 (query, new K/V rows).
FP8_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
POOL_DTYPES = (*FLOAT_DTYPES, *QUANTIZED_DTYPES)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``tensor`` is a torch.Tensor (not a meta one) of ``ndim`` dims with one of
    ``dtypes``."""
    if not isinstance(tensor, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(tensor).__name__}")
    if (problem := meta_problem(name, tensor)) is not None:
        raise ValueError(problem)
    if tensor.dim() != ndim:
        _fail(name, f"expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(name, f"dtype {str(tensor.dtype).removeprefix('torch.')} not in ({allowed})")
    if device is not None and tensor.device != device:
        _fail(name, f"on {tensor.device}, expected {device} (the device of key_cache)")
    if contiguous and not tensor.is_contiguous():
        _fail(name, "must be contiguous")
    return tensor


# Windows up to this many tokens (the kernels take it as a 64-bit integer); a larger one
# would cover any context anyway: pass None.
MAX_WINDOW = 2**62


def check_positive(name: str, value: object, *, integer: bool = False) -> None:
    """Check that ``value`` is a finite positive number (a whole one with ``integer``, at
    most ``MAX_WINDOW``); a non-integer one must stay finite and above zero in float32,
    the kernels' type for it.

    Bools are refused: ``sliding_window=True`` is a mistake, not a window of one token.
    """
    kind = "a positive integer" if integer else "a finite positive number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, f"must be {kind}, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number <= 0 or (integer and not number.is_integer()):
        _fail(name, f"must be {kind}, got {value}")
    if integer and number > MAX_WINDOW:
        _fail(name, f"must be at most 2**62, got {value} (None for no limit)")
    if not integer:
        single = torch.tensor(number, dtype=torch.float32, device="cpu").item()
        if not math.isfinite(single) or single == 0.0:
            _fail(name, f"{value} is outside float32's range, the kernels' type for it")


def check_kv_pools(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Pools: [num_blocks, block_size, num_kv_heads, head_dim], same shape/dtype/device."""
    check_tensor("key_cache", key_cache, ndim=4, dtypes=POOL_DTYPES, contiguous=True)
    check_tensor(
        "value_cache",
        value_cache,
        ndim=4,
        dtypes=(key_cache.dtype,),
        device=key_cache.device,
        contiguous=True,
    )
    if value_cache.shape != key_cache.shape:
        _fail(
            "value_cache",
            f"shape {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}",
        )
    if min(key_cache.shape) == 0:
        _fail("key_cache", f"has an empty dimension: shape {tuple(key_cache.shape)}")
    if _overlap(key_cache, value_cache):
        _fail("value_cache", "shares memory with key_cache: K and V need pools of their own")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors (of any dtypes) share any byte of memory."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


def check_kv_scales(
    key_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    value_cache: torch.Tensor,
) -> None:
    """FP8 pools need float32 ``k_scale``/``v_scale`` [Hkv] on the pools' device, finite
    and positive; INT8 pools float16 per-slot scales (``quant.int8_scale_shape``: keys per
    group of channels, values per head), contiguous, sharing no memory with each other or
    the pools; other pools take none (a scale that would be ignored
    is refused)."""
    num_kv_heads = key_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if key_cache.dtype not in QUANTIZED_DTYPES:
            if scale is not None:
                _fail(name, f"given for {key_cache.dtype} pools; only FP8/INT8 pools take scales")
            continue
        if scale is None:
            _fail(
                name,
                f"required: the pools hold {str(key_cache.dtype).removeprefix('torch.')} values",
            )
        if key_cache.dtype == INT8_DTYPE:
            check_tensor(
                name, scale, ndim=4, dtypes=(INT8_SCALE_DTYPE,), device=key_cache.device,
                contiguous=True,
            )  # fmt: skip
            want = int8_scale_shape(key_cache.shape, INT8_K_GROUP if name == "k_scale" else None)
            if tuple(scale.shape) != want:
                _fail(name, f"shape {tuple(scale.shape)} must be {list(want)} for these pools")
            continue
        check_tensor(name, scale, ndim=1, dtypes=(torch.float32,), device=key_cache.device)
        if scale.shape[0] > 1 and scale.stride(0) != 1:  # the kernels read scale + head
            _fail(name, "must be contiguous (a strided view reads other heads' scales)")
        if scale.shape[0] != num_kv_heads:
            _fail(name, f"has {scale.shape[0]} entries for {num_kv_heads} KV heads")
        if not bool(torch.isfinite(scale).all() & (scale > 0).all()):
            _fail(name, "must be finite and positive")
    if key_cache.dtype == INT8_DTYPE and _overlap(k_scale, v_scale):
        _fail("v_scale", "shares memory with k_scale: K and V need scales of their own")
    if key_cache.dtype in QUANTIZED_DTYPES:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if _overlap(scale, key_cache) or _overlap(scale, value_cache):
                _fail(name, "shares memory with the pools: the scatter would overwrite it")


def compute_dtypes(key_cache: torch.Tensor) -> tuple[torch.dtype, ...]:
    """Dtypes a query or new K/V row may have for these pools."""
    return FP8_COMPUTE_DTYPES if key_cache.dtype in QUANTIZED_DTYPES else (key_cache.dtype,)


def check_slot_scatter_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Validate slot-scatter arguments (see ``slot_scatter_ref`` for shapes)."""
    check_kv_pools(key_cache, value_cache)
    check_kv_scales(key_cache, k_scale, v_scale, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    device = key_cache.device
    check_tensor("key", key, ndim=3, dtypes=compute_dtypes(key_cache), device=device)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device)
    if tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        _fail("key", f"shape {tuple(key.shape)} must be [T, {num_kv_heads}, {head_dim}]")
    if value.shape != key.shape:
        _fail("value", f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    check_slot_mapping(slot_mapping, key.shape[0], device)
    check_slot_values(slot_mapping, num_blocks * block_size)


def check_slot_mapping(slot_mapping: torch.Tensor, tokens: int, device: torch.device) -> None:
    """A slot for each of ``tokens`` rows: int32/int64 [tokens] on ``device`` (reads no
    value)."""
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if slot_mapping.shape[0] != tokens:
        _fail("slot_mapping", f"has {slot_mapping.shape[0]} entries for {tokens} tokens")


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots in [-1, num_slots) (-1: the row is not stored), none twice. Reads the values
    (a sync)."""
    if slot_mapping.numel() > 0:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            _fail("slot_mapping", f"values in [{lo}, {hi}] outside [-1, {num_slots - 1}]")
        real = slot_mapping[slot_mapping >= 0]
        if real.numel() != torch.unique(real).numel():
            _fail("slot_mapping", "writes the same slot twice")


def check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    *,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Validate paged attention arguments; ``cu_seqlens_q=None`` means decode (one token each).
    Returns the host copy of ``seq_lens`` it checked (None for no sequences)."""
    check_kv_pools(key_cache, value_cache)
    check_kv_scales(key_cache, k_scale, v_scale, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    device = key_cache.device
    check_tensor("query", query, ndim=3, dtypes=compute_dtypes(key_cache), device=device)
    if query.shape[2] != head_dim:
        _fail("query", f"head_dim {query.shape[2]} differs from the pool's {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        _fail(
            "query",
            f"{query.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads",
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        _fail("seq_lens", f"has {seq_lens.shape[0]} entries for {num_seqs} block_tables rows")
    if cu_seqlens_q is None:
        if query.shape[0] != num_seqs:
            _fail("query", f"has {query.shape[0]} rows for {num_seqs} sequences (decode)")
    else:
        check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device)
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            _fail("cu_seqlens_q", f"has {cu_seqlens_q.shape[0]} entries, expected {num_seqs + 1}")
    if scale is not None:
        check_positive("scale", scale)
    if sliding_window is not None:
        check_positive("sliding_window", sliding_window, integer=True)
    if softcap is not None:
        check_positive("softcap", softcap)
    if num_seqs == 0:  # nothing to attend: the query must have no rows either
        if query.shape[0] != 0:
            _fail("query", f"has {query.shape[0]} rows for 0 sequences")
        if cu_seqlens_q is not None and int(cu_seqlens_q.cpu()[0]) != 0:
            _fail("cu_seqlens_q", "must run from 0 to 0 (the query rows)")
        return None
    lens = seq_lens.cpu()
    capacity = block_tables.shape[1] * block_size
    if int(lens.min()) < 0:  # 0: a row with no tokens yet (all padding so far)
        _fail("seq_lens", f"must be >= 0, got min {int(lens.min())}")
    if int(lens.max()) > capacity:
        _fail(
            "seq_lens",
            f"max {int(lens.max())} exceeds the table's capacity "
            f"{block_tables.shape[1]} blocks x {block_size}",
        )
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.cpu()
        q_lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != query.shape[0]:
            _fail("cu_seqlens_q", f"must run from 0 to {query.shape[0]} (the query rows)")
        if bool((q_lens < 0).any()):
            _fail("cu_seqlens_q", "must be non-decreasing")
        if bool((q_lens > lens).any()):
            _fail("cu_seqlens_q", "a sequence has more new tokens than seq_lens counts")
    used_blocks = (lens + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device="cpu")
    used = block_tables.cpu()[cols[None, :] < used_blocks[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        _fail(
            "block_tables",
            f"block ids in [{int(used.min())}, {int(used.max())}] outside the pool "
            f"[0, {num_blocks - 1}]",
        )
    return lens
