"""A pure read of N bytes (a Triton reduction over a bf16 buffer): the bandwidth ceiling a
memory-bound kernel of that size is held to."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(x, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc, 0))


def pure_read_fns(nbytes: int, sets: int, device: str = "cuda") -> list[list[Callable]]:
    """For each read config, one closure per input set that reads ``nbytes`` of bf16 once."""
    n = nbytes // 2
    bufs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    variants = []
    for block, iters, warps in ((4096, 4, 8), (2048, 8, 4), (8192, 2, 8)):
        grid = (triton.cdiv(n, block * iters),)
        out = torch.empty(grid[0], device=device)

        def make(buf, block=block, iters=iters, warps=warps, grid=grid, out=out):
            return lambda: _read_kernel[grid](buf, out, n, block, iters, num_warps=warps)

        variants.append([make(b) for b in bufs])
    return variants
