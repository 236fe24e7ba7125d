"""A decode step's token pick from its scores: kernel launcher and reference.

After the processors a step picks each row's token as ``argmax(scores)`` (greedy) or, with
noise ``q ~ Exp(1)``, ``argmax(probs / q)`` (how ``torch.multinomial`` draws one sample),
then gives finished rows the pad token, clears the flag of rows that drew an EOS id and moves
the positions on. Eagerly that is about fifteen small launches; ``pick_tokens`` is two. The
result is the eager ops' exactly: the division rounds as ``torch.div`` does and the first
largest entry wins, NaN counting as the largest (``torch.argmax``).
"""

from __future__ import annotations

import torch

from nanoserve.kernels.dispatch import next_pow2, pdl_launch, use_triton

# entries of a row a first-pass program reads
CHUNK = 4096
# rows the second pass takes at a time
ROWS = 16


def pick_tokens_ref(
    scores: torch.Tensor,
    noise: torch.Tensor | None = None,
    noise_rows: torch.Tensor | None = None,
    unfinished: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
    eos: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (the eager ops). scores float32 [B, V] (probabilities when ``noise`` is
    given); noise float32 [T, V] with T = B, or T >= B and ``noise_rows`` int64 [B] naming
    each row's noise row; unfinished bool [B] (needed with pad or eos); pad int64 [] (or
    [1]); eos int64 [E]; positions int64 [B, 1].

    Returns (tokens int64 [B], invalid bool []: some row's chosen ratio is NaN). Updates in
    place: ``unfinished &= token is no EOS id`` (after the pad), ``positions += 1``."""
    ratio = scores
    if noise is not None:
        q = noise if noise_rows is None else noise.index_select(0, noise_rows)
        ratio = torch.div(scores, q)
    tokens = torch.argmax(ratio, dim=-1)
    invalid = ratio.gather(1, tokens[:, None]).isnan().any()
    if pad is not None:
        tokens = torch.where(unfinished, tokens, pad.reshape(()))
    if eos is not None:  # (not torch.isin: from 10 ids on it reads back to the host)
        unfinished &= (tokens[:, None] != eos[None, :]).all(dim=1)
    if positions is not None:
        positions += 1
    return tokens, invalid


def input_problem(scores, noise, noise_rows, unfinished, pad, eos, positions) -> str | None:
    """Why ``pick_tokens`` refuses these arguments (the ValueError's message), or None."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        return f"scores: expected a [B, V] tensor, got {getattr(scores, 'shape', type(scores))}"
    rows, vocab = scores.shape
    if scores.dtype != torch.float32 or scores.stride(1) != 1 or vocab == 0:
        return "scores: expected float32 [B, V] with V >= 1 and unit stride in V"
    device = scores.device
    if noise is not None:
        if noise.dtype != torch.float32 or noise.dim() != 2 or noise.shape[1] != vocab:
            return f"noise: expected float32 [T, {vocab}], got {noise.dtype} {tuple(noise.shape)}"
        if noise.stride(1) != 1 or noise.device != device:
            return "noise: expected unit stride in V, on scores' device"
        if noise_rows is None and noise.shape[0] != rows:
            return f"noise: {noise.shape[0]} rows for {rows} scores rows without noise_rows"
    if noise_rows is not None and (
        noise is None or noise_rows.shape != (rows,) or noise_rows.dtype != torch.int64
        or noise_rows.device != device or not noise_rows.is_contiguous()
    ):  # fmt: skip
        return f"noise_rows: expected contiguous int64 [{rows}] on scores' device, with noise"
    needs_flags = pad is not None or eos is not None
    if needs_flags and (
        unfinished is None or unfinished.shape != (rows,) or unfinished.dtype != torch.bool
        or unfinished.device != device or not unfinished.is_contiguous()
    ):  # fmt: skip
        return f"unfinished: expected contiguous bool [{rows}] on scores' device (pad / eos)"
    if pad is not None and (pad.numel() != 1 or pad.dtype != torch.int64 or pad.device != device):
        return "pad: expected one int64 on scores' device"
    if eos is not None and (
        eos.dim() != 1 or eos.dtype != torch.int64 or eos.device != device
        or not eos.is_contiguous()
    ):  # fmt: skip
        return "eos: expected contiguous int64 [E] on scores' device"
    if positions is not None and (
        positions.shape != (rows, 1) or positions.dtype != torch.int64
        or positions.device != device or not positions.is_contiguous()
    ):  # fmt: skip
        return f"positions: expected contiguous int64 [{rows}, 1] on scores' device"
    return None


def pick_tokens(
    scores: torch.Tensor,
    noise: torch.Tensor | None = None,
    noise_rows: torch.Tensor | None = None,
    unfinished: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
    eos: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pick_tokens_ref``'s result (and in-place updates) in two Triton launches on CUDA
    (``backend="auto"`` with Triton installed); the reference elsewhere, or with
    ``backend="torch"``; ``backend="triton"`` on CPU needs TRITON_INTERPRET=1. No host sync:
    ``invalid`` stays on the device."""
    problem = input_problem(scores, noise, noise_rows, unfinished, pad, eos, positions)
    if problem is not None:
        raise ValueError(problem)
    args = (scores, noise, noise_rows, unfinished, pad, eos, positions)
    if not use_triton(backend, scores):
        return pick_tokens_ref(*args)
    from nanoserve.kernels.triton_token_pick import _chunk_best_kernel, _pick_kernel

    rows, vocab = scores.shape
    device = scores.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    invalid = torch.empty((), dtype=torch.bool, device=device)
    if rows == 0:
        invalid.fill_(False)
        return tokens, invalid
    chunks = -(-vocab // CHUNK)
    best_value = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    best_index = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    launch = pdl_launch(device)
    _chunk_best_kernel[(rows, chunks)](
        scores, noise if noise is not None else scores,
        noise_rows if noise_rows is not None else best_index,
        best_value, best_index, vocab, chunks,
        scores.stride(0), noise.stride(0) if noise is not None else 0,
        CHUNK=CHUNK, HAS_NOISE=noise is not None, HAS_ROWS=noise_rows is not None,
        PDL=bool(launch), num_warps=8, **launch,
    )  # fmt: skip
    dummy = tokens
    _pick_kernel[(1,)](
        best_value, best_index, tokens, invalid,
        unfinished if unfinished is not None else dummy,
        pad if pad is not None else dummy,
        eos if eos is not None else dummy, eos.shape[0] if eos is not None else 0,
        positions if positions is not None else dummy, rows, chunks,
        ROWS=ROWS, CHUNKS_PAD=max(2, next_pow2(chunks)),
        HAS_PAD=pad is not None, HAS_EOS=eos is not None,
        HAS_POSITIONS=positions is not None, PDL=bool(launch), num_warps=4, **launch,
    )  # fmt: skip
    return tokens, invalid
