"""Prefill with and without fuse_decode's forwards in prefill steps, one process.

A random-weight Llama-3.2-1B-shaped model in bf16 (``bench_generate.build_model``), each call
``generate(..., max_new_tokens=1)`` on fresh random prompts with ``prefix_sharing=False``
(every call computes its prompts), under patches made alternately with
``graph_forward.FUSE_PREFILL`` off ("unfused": the prefill runs transformers' modules) and on
("fused"), two rounds. Per shape: the median wall time of 5 calls after 3 warm-ups (whose
second sighting of a shape may capture its extend graph) and the GPU kernel time and kernel
count of one more call under torch.profiler; then how many greedy tokens of 8 rows agree
over 64 new tokens between the two (bf16: near ties may part).
``--end-to-end``: instead, whole calls of 256 new greedy tokens at batch 1 (prompt 512) and on
a ragged 32 (128..2048), a patch per form and round, 4 rounds whose first form alternates,
each timed call after three of the same shape (the first makes the pool, the third captures
the prefill's extend graph over it); writes $OUT/prefill_end_to_end.csv.
Usage: cd benchmarks && python3 bench_prefill.py [--end-to-end]; writes $OUT/prefill.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_prefill")

from bench_generate import (  # noqa: E402
    build_model,
    kernel_launches,
    kernel_seconds,
    left_padded,
    run_generate,
)
from harness import show_table, versions  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.adapters import graph_forward  # noqa: E402

SHAPES = {
    "1 x 512": [512],
    "8 x 300": [300] * 8,
    "1 x 2048": [2048],
    "4 x 2112": [2112] * 4,
    "ragged 32 x 128..2048": [int(n) for n in torch.linspace(128, 2048, 32)],
}
COLUMNS = ["shape", "tokens", "provider", "wall_ms", "gpu_ms", "kernels", "gpu_x_unfused"]


def one_call(model, ids, mask) -> float:
    """Milliseconds of a prefill-only generate call."""
    return run_generate(model, ids, mask, 1, "cuda")[1] * 1e3


def profiled(model, ids, mask) -> tuple[float, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
    events = prof.key_averages()
    return kernel_seconds(events) * 1e3, kernel_launches(events)


def end_to_end(model) -> None:
    """Whole calls with fused prefill steps off and on (the module docstring)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    shapes = {"batch 1, prompt 512": [512], "ragged 32, 128..2048": SHAPES["ragged 32 x 128..2048"]}
    seconds: dict[tuple[str, str], list[float]] = {}

    def call(lens) -> float:
        return run_generate(model, *left_padded(lens, vocab, gen, "cuda"), 256, "cuda")[1]

    for round_ in range(4):
        for provider in ("unfused", "fused")[:: 1 if round_ % 2 == 0 else -1]:
            graph_forward.FUSE_PREFILL = provider == "fused"
            nanoserve.patch_model(model, prefix_sharing=False)
            try:
                for shape, lens in shapes.items():
                    for _ in range(3):
                        call(lens)
                    seconds.setdefault((shape, provider), []).append(call(lens))
            finally:
                nanoserve.release_memory(model)
                nanoserve.unpatch_model(model)
    graph_forward.FUSE_PREFILL = True
    table = []
    for (shape, provider), runs in seconds.items():
        rows = len(shapes[shape])
        table.append({"shape": shape, "provider": provider,
                      "call_s": " / ".join(f"{s:.4f}" for s in runs),
                      "tok_s_median": f"{rows * 256 / statistics.median(runs):,.0f}"})  # fmt: skip
    print(versions())
    show_table(table, "prefill_end_to_end", ["shape", "provider", "call_s", "tok_s_median"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--end-to-end", action="store_true")
    args = parser.parse_args()
    model = build_model(False, "cuda")
    if args.end_to_end:
        end_to_end(model)
        return
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    timed: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for _ in range(2):
        for provider in ("unfused", "fused"):
            graph_forward.FUSE_PREFILL = provider == "fused"
            nanoserve.patch_model(model, prefix_sharing=False)
            try:
                for shape, lens in SHAPES.items():
                    for _ in range(3):
                        one_call(model, *left_padded(lens, vocab, gen, "cuda"))
                    walls = [
                        one_call(model, *left_padded(lens, vocab, gen, "cuda")) for _ in range(5)
                    ]
                    gpu = profiled(model, *left_padded(lens, vocab, gen, "cuda"))
                    timed.setdefault((shape, provider), []).append((statistics.median(walls), *gpu))
            finally:
                nanoserve.release_memory(model)
                nanoserve.unpatch_model(model)
    table = []
    for shape, lens in SHAPES.items():
        base = min(g for _, g, _ in timed[(shape, "unfused")])
        for provider in ("unfused", "fused"):
            runs = timed[(shape, provider)]
            table.append({
                "shape": shape, "tokens": len(lens) * max(lens), "provider": provider,
                "wall_ms": " / ".join(f"{w:.2f}" for w, _, _ in runs),
                "gpu_ms": " / ".join(f"{g:.2f}" for _, g, _ in runs),
                "kernels": runs[0][2],
                "gpu_x_unfused": f"{min(g for _, g, _ in runs) / base:.2f}",
            })  # fmt: skip
    ids, mask = left_padded(
        list(range(300, 159, -20)), vocab, torch.Generator().manual_seed(5), "cuda"
    )
    tokens = {}
    for provider in ("unfused", "fused"):
        graph_forward.FUSE_PREFILL = provider == "fused"
        nanoserve.patch_model(model)
        try:
            tokens[provider] = run_generate(model, ids, mask, 64, "cuda")[0]  # (no EOS)
        finally:
            nanoserve.release_memory(model)
            nanoserve.unpatch_model(model)
    graph_forward.FUSE_PREFILL = True
    same = tokens["unfused"] == tokens["fused"]
    first = [int((~row).nonzero()[0]) if not row.all() else 64 for row in same]
    print(versions())
    print(f"greedy, 8 rows x 64 new tokens: {int(same.all(1).sum())} rows equal; each row's "
          f"first differing step (64: none): {first}")  # fmt: skip
    show_table(table, "prefill", COLUMNS)


if __name__ == "__main__":
    main()
