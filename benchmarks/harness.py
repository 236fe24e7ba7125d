"""Shared benchmark helpers: timing (eager and CUDA-graph replay), the pure-read ceiling,
error against a reference, and the table/CSV output."""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 200 * 2**20  # rotate input sets until this much is touched per round
WARMUP_MS, REP_MS = 25, 60  # do_bench warm-up and measuring time per timing


def num_input_sets(nbytes: int, max_sets: int = 8) -> int:
    """How many distinct input sets to rotate so repeats are not served from the L2."""
    return max(1, min(max_sets, -(-ROTATE_BYTES // max(nbytes, 1))))


def rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``fns[0]``, ``fns[1]``, ... in turn on successive calls."""
    state = {"i": 0}

    def run() -> object:
        i = state["i"]
        state["i"] = (i + 1) % len(fns)
        return fns[i]()

    return run


def time_eager(fns: Sequence[Callable[[], object]], rep: int = REP_MS) -> float:
    """Median microseconds of one call, rotating over ``fns`` (one per input set)."""
    ms = triton.testing.do_bench(rotating(fns), warmup=WARMUP_MS, rep=rep, return_mode="median")
    return ms * 1e3


def time_graph(fns: Sequence[Callable[[], object]], rep: int = REP_MS) -> float:
    """Median microseconds of one CUDA-graph replay, one graph captured per input set."""
    graphs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    torch.cuda.synchronize()
    return time_eager([g.replay for g in graphs], rep)


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


def ceiling_us(nbytes: int, sets: int, graph: bool) -> float:
    """Best pure-read time (µs) over a few configs for ``nbytes``: the bar for a decode."""
    timer = time_graph if graph else time_eager
    return min(timer(fns) for fns in pure_read_fns(nbytes, sets))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when out has a non-finite value)."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Markdown table of ``rows`` (dicts) restricted to ``columns``."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")


def write_csv(rows: list[dict], name: str) -> str | None:
    """Write ``rows`` to $OUT/name (if OUT is set); return the path."""
    out_dir = os.environ.get("OUT")
    if not out_dir or not rows:
        return None
    path = os.path.join(out_dir, name)
    fields = list(dict.fromkeys(k for row in rows for k in row))  # every column, first seen first
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def versions() -> str:
    """One line: GPU, SMs, torch, triton, CUDA."""
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}, CUDA {torch.version.cuda}"
    )
