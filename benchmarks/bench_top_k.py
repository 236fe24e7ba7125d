"""The top-k filter of a sampled token's choice (HF's TopKLogitsWarper: torch.topk, a compare
and masked_fill) beside nanoserve's kernels and a pure read of the scores, float32 scores
[rows, vocab], under CUDA-graph replay with inputs rotated past the L2. The same column says
whether the output equals the reference's bit for bit. ``--sweep`` also times each chunk /
warps config and prints the best per shape.
Usage: python3 benchmarks/bench_top_k.py [--quick] [--sweep]; writes $OUT/top_k.csv.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_top_k")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    quick,
    set_quick,
    show_table,
    time_graph,
    versions,
)

from nanoserve.kernels.top_k import (  # noqa: E402
    TopKConfig,
    candidates_per_chunk,
    top_k_filter,
    top_k_filter_ref,
)

VOCABS = (32000, 128256, 151936, 256000)
ROWS = (1, 4, 16, 64)
KS = (50, 20, 256)
COLUMNS = ["vocab", "rows", "k", "provider", "us", "vs_read", "same"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def time_shape(vocab, rows, k, sweep, table, best) -> None:
    nbytes = rows * vocab * 4
    sets = num_input_sets(nbytes)
    inputs = [torch.randn(rows, vocab, device="cuda") * 3 for _ in range(sets)]
    inf = -float("inf")
    ref = top_k_filter_ref(inputs[0], k, inf)
    out = top_k_filter(inputs[0], k, inf)
    read = ceiling(nbytes, sets, graph=True).median
    timings = [
        ("torch (HF's ops)", time_graph([lambda x=x: top_k_filter_ref(x, k, inf) for x in inputs]),
         same(ref, ref)),
        ("nanoserve", time_graph([lambda x=x: top_k_filter(x, k, inf) for x in inputs]),
         same(out, ref)),
        ("read", None, ""),
    ]  # fmt: skip
    for provider, timing, ok in timings:
        us = read if timing is None else timing.median
        table.append({"vocab": vocab, "rows": rows, "k": k, "provider": provider,
                      "us": f"{us:.1f}", "vs_read": f"{us / read:.2f}", "same": ok})  # fmt: skip
    if sweep:
        timed = []
        for chunk, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
            cfg = TopKConfig(chunk, warps)
            kept = candidates_per_chunk(k)
            if kept > chunk or -(-vocab // chunk) * kept > 16384:
                continue
            ok = same(top_k_filter(inputs[0], k, inf, config=cfg), ref)
            t = time_graph([lambda x=x, c=cfg: top_k_filter(x, k, inf, config=c) for x in inputs])
            timed.append((t.median, cfg, ok))
        timed.sort(key=lambda r: r[0])
        for us, cfg, ok in timed[:3]:
            best.append(f"vocab {vocab} rows {rows} k {k}: {us:.1f} us {cfg} same={ok}")
    print(f"vocab {vocab} rows {rows} k {k} done", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    set_quick(args.quick)
    torch.manual_seed(0)
    table, best = [], []
    vocabs = (128256,) if quick() else VOCABS
    for vocab, rows, k in itertools.product(vocabs, ROWS, KS):
        if k != 50 and rows not in (1, 64):
            continue
        time_shape(vocab, rows, k, args.sweep and k == 50, table, best)
    print(versions())
    for line in best:
        print(line)
    show_table(table, "top_k.csv", COLUMNS)


if __name__ == "__main__":
    main()
