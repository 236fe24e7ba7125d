"""Paged attention over the block-table layout: decode (one new token per sequence) and extend
(several new tokens per sequence, causal among themselves, over the whole paged history).

Shapes (DESIGN.md): pools [num_blocks, block_size, Hkv, D]; block_tables int32 [S, max_blocks];
seq_lens int32 [S] counting every cached token including the new ones (already written);
decode query [S, Hq, D]; extend query packed [total_q, Hq, D] with cu_seqlens_q int32 [S + 1].

Triton is imported only when a Triton kernel is launched, so the references (and the package)
work where Triton is not installed.
"""

from __future__ import annotations

import torch

from nanoserve.kernels.dispatch import check_backend, refuse_interpreted_bfloat16, use_triton
from nanoserve.kernels.quant import FP8_DTYPE, INT8_DTYPE, dequantize, dequantize_int8
from nanoserve.kernels.reference import attend_sequence, gather_history
from nanoserve.kernels.shared_prefix import SharedPrefixPlan, check_shared_prefix
from nanoserve.kernels.validation import check_attention_args, check_positive


def _dequantized_like(
    query: torch.Tensor, key_cache: torch.Tensor, extend: bool = False
) -> tuple[torch.Tensor, ...]:
    """The query, when the kernels dequantize these pools into its dtype (INT8; FP8 in the
    extend kernel, while decode meets FP8 tiles in float16), else ()."""
    into_query = key_cache.dtype == INT8_DTYPE or (extend and key_cache.dtype == FP8_DTYPE)
    return (query,) if into_query else ()


def _default_scale(head_dim: int, scale: float | None) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def paged_extend_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Reference extend attention: returns [total_q, Hq, D] in the query's dtype.

    The new tokens of sequence i are its last ``cu_seqlens_q[i+1] - cu_seqlens_q[i]``
    positions; each sees positions <= its own (and > pos - sliding_window). A sequence with
    seq_len 0 has no new tokens, hence no output rows. FP8 pools take float32
    ``k_scale``/``v_scale`` [Hkv], INT8 pools float16 per-slot scales (``quant.py``); both
    are dequantized (values times scales) before attention.
    """
    if check:
        check_attention_args(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    scale = _default_scale(query.shape[-1], scale)
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if start == end:
            continue
        if seq_len == 0:  # an empty sequence's decode row (all padding) sees nothing: zeros
            out[start:end] = 0
            continue
        keys = gather_history(key_cache, block_tables[i], seq_len)
        values = gather_history(value_cache, block_tables[i], seq_len)
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        if key_cache.dtype == INT8_DTYPE:
            k_scales = gather_history(k_scale, block_tables[i], seq_len)
            v_scales = gather_history(v_scale, block_tables[i], seq_len)
            keys = dequantize_int8(keys, k_scales, compute)
            values = dequantize_int8(values, v_scales, compute)
        elif k_scale is not None:
            keys = dequantize(keys, k_scale, compute)
            values = dequantize(values, v_scale, compute)
        out[start:end] = attend_sequence(
            query[start:end], keys, values,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Reference decode attention: query [S, Hq, D] is each sequence's last position.

    Returns [S, Hq, D] in the query's dtype; the row of a sequence with seq_len 0 (no token
    yet: all padding) is zeros.
    """
    if check:
        check_attention_args(
            query, key_cache, value_cache, block_tables, seq_lens, None,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    cu_seqlens_q = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_extend_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
        k_scale=k_scale, v_scale=v_scale, check=False,
    )  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
    backend: str = "auto",
    equal_lengths: bool | None = None,
    shared_prefix: SharedPrefixPlan | None = None,
) -> torch.Tensor:
    """Decode attention; same contract as ``paged_decode_attention_ref``.

    query [S, Hq, D] float16/bfloat16/float32 (float64 runs the reference); returns [S, Hq, D].
    ``backend``: "auto" (Triton on CUDA tensors, the reference on CPU), "triton" or "torch".
    ``check=False`` skips validation and never reads device memory on the host, so the call
    is safe under CUDA-graph capture (the split count comes from shapes only). FP8 pools
    (float8_e4m3fn) need ``k_scale``/``v_scale`` float32 [Hkv], INT8 pools their float16
    per-slot scales; the query is then float16/bfloat16/float32. ``equal_lengths``: whether
    every ``seq_lens`` entry is the same (the Triton launch then splits each row evenly
    instead of balancing work across rows: faster there, exact either way); None: read from
    the lengths the check copies to the host, False without the check. ``shared_prefix``: a
    ``SharedPrefixPlan`` (``plan_shared_prefix``) of rows whose tables begin with the same
    blocks; the Triton launch reads those blocks once for all of them (the same attention,
    summed in another order). The check refuses a plan that does not hold for the tables; an
    unchecked wrong plan attends rows to other rows' keys.
    """
    check_backend(backend)
    if check:
        lens = check_attention_args(
            query, key_cache, value_cache, block_tables, seq_lens, None,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        if equal_lengths is None and lens is not None:
            equal_lengths = bool(lens.min() == lens.max())
        if shared_prefix is not None:
            shared_prefix = SharedPrefixPlan(*shared_prefix)
            check_shared_prefix(shared_prefix, block_tables, seq_lens, key_cache.shape[1])
    if use_triton(backend, key_cache):
        from nanoserve.kernels.triton_decode import paged_decode_attention_triton

        refuse_interpreted_bfloat16(key_cache, *_dequantized_like(query, key_cache))
        return paged_decode_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens,
            scale=_default_scale(query.shape[-1], scale),
            sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
            equal_lengths=bool(equal_lengths), shared_prefix=shared_prefix,
        )  # fmt: skip
    return paged_decode_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
        k_scale=k_scale, v_scale=v_scale, check=False,
    )  # fmt: skip


def paged_extend_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
    backend: str = "auto",
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Extend attention; same contract as ``paged_extend_attention_ref``.

    query packed [T, Hq, D] with cu_seqlens_q int32 [S + 1]; returns [T, Hq, D].
    ``backend`` and ``check`` as in ``paged_decode_attention`` (no host sync with check=False).
    ``max_query_len``: optional host-known bound on the new tokens of any one sequence; a
    small one (speculative verify), or a turn of up to 128 over a long history (as long as
    the block tables can hold), routes to the GQA-packed split-KV kernel. It only picks the
    kernel: a wrong bound is slower, never wrong.
    """
    check_backend(backend)
    if max_query_len is not None:
        check_positive("max_query_len", max_query_len, integer=True)
    if check:
        check_attention_args(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if use_triton(backend, key_cache):
        from nanoserve.kernels.triton_extend import paged_extend_attention_triton

        refuse_interpreted_bfloat16(key_cache, *_dequantized_like(query, key_cache, extend=True))
        return paged_extend_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
            scale=_default_scale(query.shape[-1], scale),
            sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
            max_query_len=None if max_query_len is None else int(max_query_len),
        )  # fmt: skip
    return paged_extend_attention_ref(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
        k_scale=k_scale, v_scale=v_scale, check=False,
    )  # fmt: skip
