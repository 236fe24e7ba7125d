"""Where a decode step's time goes: batch 1, prompt 512, random Llama-3.2-1B shapes, bf16.

Prints, for the patched model with CUDA graphs: tokens/s of a generate call, the GPU time of
one graph replay alone (CUDA events over back-to-back replays), the host time per step inside
the patched forward and its parts (begin_step, buffer load, replay launch, logits copy), the
rest of generate's loop per step, and the kernels one eager decode step launches. The same
tokens/s and GPU time per step for HF's static cache + torch.compile sit beside it.

Usage: python3 benchmarks/profile_decode_step.py [--new-tokens 128] [--static] [--compile-decode]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import build_model, make_batches, run_generate  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.adapters import decode_graphs, hf_cache  # noqa: E402


class Table(list):
    """(name, value) rows, each printed as it comes (a later crash keeps the earlier ones)."""

    def append(self, row) -> None:
        super().append(row)
        print(format_row(*row), flush=True)


def format_row(name: str, value) -> str:
    return f"{name:55s} {value:10.3f}" if isinstance(value, float) else f"{name:55s} {value}"


class Timers:
    """Wall time spent inside chosen functions, by name."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.undo = []

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)  # generate reads forward's signature
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self.undo):
            setattr(owner, attr, original)


def replay_gpu_us(model, reps: int = 200) -> float:
    """GPU microseconds of one replay of the patched model's batch-1 decode graph."""
    graphs = nanoserve.adapters.state_of(model).graphs
    captured = next(iter(graphs.graphs.values()))
    for _ in range(10):
        captured.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        captured.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def kernels_per_step(run, steps: int) -> tuple[int, float, list]:
    """(kernel launches, summed kernel µs, top kernels) per step of ``run``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in events)
    by_name, count = collections.Counter(), collections.Counter()
    for e in events:
        by_name[e.name[:60]] += e.device_time
        count[e.name[:60]] += 1
    top = [(n, t / steps, count[n] / steps) for n, t in by_name.most_common(30)]
    return len(events) // steps, total / steps, top


def report_kernels(label: str, model, ids, mask, steps: int, table: Table, **kwargs) -> None:
    """Kernels per step and their summed time over a ``steps``-token generate call."""
    launches, kernel_us, top = kernels_per_step(
        lambda: run_generate(model, ids, mask, steps, "cuda", **kwargs), steps
    )
    table.append((f"{label}: kernels per step", launches))
    table.append((f"{label}: summed kernel ms per step", kernel_us / 1e3))
    print(f"top kernels, {label}, µs per step:")
    for name, us, launches in top:
        print(f"  {us:9.1f} µs {launches:6.1f}x  {name}")


def host_breakdown(model, ids, mask, new: int, table: Table) -> None:
    """Host time per decode step inside the patched forward, by part, and a cProfile."""
    timers = Timers()
    timers.wrap(model, "forward", "patched forward (host)")
    timers.wrap(hf_cache.PagedCache, "begin_step", "begin_step")
    timers.wrap(decode_graphs.StaticStep, "load", "static load")
    timers.wrap(torch.cuda.CUDAGraph, "replay", "graph replay launch")
    timers.wrap(decode_graphs, "_trim", "logits copy")
    try:
        _, secs = run_generate(model, ids, mask, new, "cuda")
    finally:
        timers.restore()
    table.append(("  generate wall per step (timed run) ms", secs / new * 1e3))
    for name, seconds in timers.seconds.items():
        table.append((f"  {name} ms/call", seconds / max(timers.calls[name], 1) * 1e3))
    forward_ms = timers.seconds["patched forward (host)"] / new * 1e3
    table.append(("  generate loop outside forward ms/step", secs / new * 1e3 - forward_ms))
    table.append(("  decode steps through graphs", timers.calls["static load"]))
    profiler = cProfile.Profile()
    profiler.enable()
    run_generate(model, ids, mask, new, "cuda")
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    print(text.getvalue()[-16000:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--static", action="store_true", help="also HF static + compile")
    parser.add_argument("--compile-decode", action="store_true",
                        help="also patch_model(..., compile_decode=True)")  # fmt: skip
    args = parser.parse_args()
    model = build_model(False, "cuda")
    ids, mask, _ = make_batches(False, "cuda", model.config.vocab_size)["batch1_prompt512"]
    new = args.new_tokens
    table = Table()

    nanoserve.patch_model(model)
    run_generate(model, ids, mask, 4, "cuda")  # Triton compiles, graph captured
    _, secs = run_generate(model, ids, mask, new, "cuda")
    table.append(("nanoserve graphs: ms/token (generate)", secs / new * 1e3))
    table.append(("nanoserve graphs: replay GPU ms", replay_gpu_us(model) / 1e3))

    host_breakdown(model, ids, mask, new, table)
    report_kernels("graphs (default, replays)", model, ids, mask, 64, table)
    nanoserve.unpatch_model(model)

    nanoserve.patch_model(model, cuda_graphs=False)
    run_generate(model, ids, mask, 4, "cuda")
    report_kernels("eager patched (prefill included /33)", model, ids, mask, 33, table)
    nanoserve.unpatch_model(model)

    if args.static:
        kw = dict(cache_implementation="static")
        run_generate(model, ids, mask, new, "cuda", **kw)
        _, secs = run_generate(model, ids, mask, new, "cuda", **kw)
        table.append(("HF static+compile: ms/token (generate)", secs / new * 1e3))
        report_kernels("HF static+compile", model, ids, mask, 64, table, **kw)

    if args.compile_decode:
        nanoserve.patch_model(model, compile_decode=True)
        start = time.perf_counter()
        run_generate(model, ids, mask, 4, "cuda")
        table.append(("compile_decode: first call s", time.perf_counter() - start))
        _, secs = run_generate(model, ids, mask, new, "cuda")
        table.append(("compile_decode graphs: ms/token (generate)", secs / new * 1e3))
        table.append(("compile_decode graphs: replay GPU ms", replay_gpu_us(model) / 1e3))
        host_breakdown(model, ids, mask, new, table)
        print("graphs:", nanoserve.decode_graph_stats(model))
        nanoserve.unpatch_model(model)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for row in table:
        print(format_row(*row))


if __name__ == "__main__":
    main()
