"""Shared benchmark helpers, on ``triton.testing``: the CUDA check every script makes first,
timing (``do_bench`` eager, ``do_bench_cudagraph`` under CUDA-graph replay) rotating over
input sets, the pure-read ceiling, error against a reference, and the results table (printed
as markdown with tabulate, saved as CSV under $OUT).

The kernel benchmarks (decode, extend, scatter) draw their per-provider plots and CSVs with
``triton.testing.perf_report``; ``print_table`` / ``write_csv`` remain for bench_generate and
bench_families.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 200 * 2**20  # rotate input sets until this much is touched per round
WARMUP_MS, REP_MS = 25, 60  # do_bench warm-up and measuring time per timing
QUICK_REP_MS = 20  # --quick: shorter measuring per timing (do_bench_cudagraph replays 10x this)
QUICK_ENV = "NANOSERVE_BENCH_QUICK"  # "1": the kernel benchmarks run their --quick shapes
# Untimed generate calls before a patched model is timed: the first stores the prompts' blocks,
# the second is the first to read them back, and each compiles (and autotunes) its own kernels.
WARM_UP_CALLS = 2
_SALTS = itertools.count()


def fresh_salt() -> str:
    """A ``cache_salt`` no earlier call of this process used. A patched model's call given
    one finds none of the prompt blocks the benchmark's earlier calls stored, so it prefills
    its prompts as a call with new prompts does: timing repeated calls on the same prompts
    would skip that prefill and flatter nanoserve beside providers without a prefix cache.
    Counted, not random: a process never draws one twice, so tensor-parallel ranks all miss
    alike (their cache decisions must agree)."""
    return f"nanoserve-benchmark-{next(_SALTS)}"


def quick() -> bool:
    """Whether this run is a quick one (``--quick``, or run_all --quick through the
    environment): every shape class, fewer sizes, shorter timings."""
    return os.environ.get(QUICK_ENV) == "1"


def set_quick(on: bool) -> None:
    """Turn quick mode on for this process and the scripts it starts."""
    if on:
        os.environ[QUICK_ENV] = "1"


def rep_ms() -> int:
    """do_bench measuring time per timing: shorter in quick mode."""
    return QUICK_REP_MS if quick() else REP_MS


def require_cuda(script: str) -> None:
    """Exit with one line on stderr when torch sees no CUDA GPU: every benchmark here times
    GPU kernels. Call it before importing Triton or the kernels."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU, and torch {torch.__version__} sees none")


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


class Timing(NamedTuple):
    """Microseconds of one call: median, 20th and 80th percentile."""

    median: float
    p20: float
    p80: float


def time_eager(fns: Sequence[Callable[[], object]], rep: int | None = None) -> Timing:
    """One call's µs, launched from Python, rotating over ``fns`` (one per input set);
    ``triton.testing.do_bench`` clears the L2 before each call."""
    from triton.testing import do_bench

    rep = rep or rep_ms()
    ms = do_bench(rotating(fns), warmup=WARMUP_MS, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return Timing(*(m * 1e3 for m in ms))


def time_graph(fns: Sequence[Callable[[], object]], rep: int | None = None) -> Timing:
    """One call's µs under CUDA-graph replay (``triton.testing.do_bench_cudagraph``: many
    calls captured in one graph, so no launch cost), the calls rotating over ``fns``."""
    from triton.testing import do_bench_cudagraph

    ms = do_bench_cudagraph(rotating(fns), rep=rep or rep_ms(), quantiles=[0.5, 0.2, 0.8])
    return Timing(*(m * 1e3 for m in ms))


def ceiling(nbytes: int, sets: int, graph: bool) -> Timing:
    """Best pure read of ``nbytes`` (over a few launch configs): the bar for a decode."""
    from pure_read import pure_read_fns

    timer = time_graph if graph else time_eager
    return min((timer(fns) for fns in pure_read_fns(nbytes, sets)), key=lambda t: t.median)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when out has a non-finite value)."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """Sums in float64 of ``t`` (any dtype) and of its odd-indexed elements: they change when
    any part of ``t`` is overwritten. Reductions only: no copy of a pool of many GiB."""
    flat = t.reshape(-1)
    return (
        torch.sum(flat, dtype=torch.float64).item(),
        torch.sum(flat[1::2], dtype=torch.float64).item(),
    )


class Reference:
    """A reference output kept on the host in float64, beside fingerprints of the inputs it
    was computed from: device memory reused or overwritten after the reference was taken
    (a freed buffer, a stray write) can change neither the reference nor go unnoticed.

    ``ref`` [n, ...] covers the first n rows of a provider's output; ``inputs`` name the
    device tensors every provider reads (query, pools, tables, lengths)."""

    def __init__(self, ref: torch.Tensor, inputs: dict[str, torch.Tensor]):
        self.ref = ref.detach().to("cpu", torch.float64)
        self.inputs = inputs
        self.prints = {name: fingerprint(t) for name, t in inputs.items()}

    def changed(self) -> list[str]:
        """The inputs that no longer hold what the reference was computed from."""
        return [n for n, t in self.inputs.items() if fingerprint(t) != self.prints[n]]

    def err(self, out: torch.Tensor) -> str:
        """``rel_err`` of ``out``'s first rows against the reference, as the table prints it,
        or which inputs changed since the reference was taken."""
        changed = self.changed()
        if changed:
            return "inputs changed: " + " ".join(changed)
        return f"{rel_err(out[: self.ref.shape[0]].detach().cpu(), self.ref):.1e}"


def show_table(rows: list[dict], name: str, columns: list[str] | None = None) -> None:
    """Print ``rows`` as a markdown table (``columns`` only, in order, when given; a missing
    or NaN value prints empty) and write them whole to $OUT/name when OUT is set."""
    from tabulate import tabulate

    columns = columns or list(dict.fromkeys(k for row in rows for k in row))

    def cell(value) -> str:
        missing = value is None or (isinstance(value, float) and math.isnan(value))
        return "" if missing else str(value)

    table = [[cell(row.get(c)) for c in columns] for row in rows]
    print(tabulate(table, headers=columns, tablefmt="pipe", disable_numparse=True))
    write_csv(rows, name)


def out_dir() -> str:
    """Where ``perf_report`` saves its plots and CSVs: $OUT, or nowhere ("")."""
    return os.environ.get("OUT", "")


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Markdown table of ``rows`` (dicts) restricted to ``columns``."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")


def write_csv(rows: list[dict], name: str) -> str | None:
    """Write ``rows`` to $OUT/name (if OUT is set; the folder is made if missing); return the
    path."""
    out_dir = os.environ.get("OUT")
    if not out_dir or not rows:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fields = list(dict.fromkeys(k for row in rows for k in row))  # every column, first seen first
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def versions() -> str:
    """One line: GPU, SMs, torch, triton, CUDA."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}, CUDA {torch.version.cuda}"
    )
