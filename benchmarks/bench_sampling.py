"""A sampled decode step's token choice kernels beside the eager torch ops they replace, at
real vocabularies, float32 scores, under CUDA-graph replay with inputs rotated past the L2:

- ``top_k``: HF's top-k warper (``scores < topk(scores, k)[0][..., -1:]`` filled), eager
  ``torch.topk`` plus the comparison and ``masked_fill``, against ``top_k_filter`` (three
  launches). The bytes a launch must move: the scores read and the result written.
- ``pick``: a sampled row's token (``argmax(probs / noise)``), the pad after EOS, the EOS test
  and the positions, eager against ``pick_tokens`` (two launches). The bytes: the
  probabilities and the noise read.

``read`` is a pure read of the same bytes (the bar); ``equal``: the fraction of outputs
bit-equal to the eager ops'.
Usage: python3 benchmarks/bench_sampling.py [--quick]; writes $OUT/sampling.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_sampling")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    set_quick,
    show_table,
    time_graph,
    versions,
)

from nanoserve.kernels.token_pick import pick_tokens, pick_tokens_ref  # noqa: E402
from nanoserve.kernels.top_k import top_k_filter, top_k_filter_ref  # noqa: E402

VOCABS = (128256, 151936)  # Llama 3's and Qwen 2.5's
ROWS = (1, 8, 16, 64)
TOP_K = 50  # generate's default top_k
COLUMNS = ["op", "vocab", "rows", "provider", "us", "GB/s", "vs_read", "equal"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of entries equal, NaN matching NaN."""
    return ((a == b) | (a.isnan() & b.isnan())).float().mean().item()


def time_top_k(vocab: int, rows: int, table: list[dict]) -> None:
    nbytes = 2 * rows * vocab * 4
    sets = num_input_sets(nbytes, max_sets=16)
    scores = [3 * torch.randn(rows, vocab, device="cuda") for _ in range(sets)]
    equal = same_bits(top_k_filter(scores[0], TOP_K), top_k_filter_ref(scores[0], TOP_K))
    timings = [
        ("eager", time_graph([lambda s=s: top_k_filter_ref(s, TOP_K) for s in scores]).median, ""),
        ("nanoserve", time_graph([lambda s=s: top_k_filter(s, TOP_K) for s in scores]).median,
         f"{equal:.6f}"),
        ("read", ceiling(nbytes, sets, graph=True).median, ""),
    ]  # fmt: skip
    add_rows(table, "top_k", vocab, rows, nbytes, timings)


def time_pick(vocab: int, rows: int, table: list[dict]) -> None:
    nbytes = 2 * rows * vocab * 4
    sets = num_input_sets(nbytes, max_sets=16)
    eos = torch.tensor([2, 7], device="cuda")
    pad = torch.tensor(0, device="cuda")
    inputs = []
    for _ in range(sets):
        probs = torch.softmax(3 * torch.randn(rows, vocab, device="cuda"), dim=-1)
        noise = torch.empty_like(probs).exponential_(1)
        unfinished = torch.ones(rows, dtype=torch.bool, device="cuda")
        positions = torch.zeros(rows, 1, dtype=torch.int64, device="cuda")
        inputs.append((probs, noise, None, unfinished, pad, eos, positions))
    got = pick_tokens(*inputs[0])[0]
    equal = (got == pick_tokens_ref(*inputs[0])[0]).float().mean().item()
    timings = [
        ("eager", time_graph([lambda a=a: pick_tokens_ref(*a) for a in inputs]).median, ""),
        ("nanoserve", time_graph([lambda a=a: pick_tokens(*a) for a in inputs]).median,
         f"{equal:.6f}"),
        ("read", ceiling(nbytes, sets, graph=True).median, ""),
    ]  # fmt: skip
    add_rows(table, "pick", vocab, rows, nbytes, timings)


def add_rows(table, op, vocab, rows, nbytes, timings) -> None:
    read = timings[-1][1]
    for provider, us, equal in timings:
        row = {"op": op, "vocab": vocab, "rows": rows, "provider": provider, "us": f"{us:.2f}"}
        gbs = nbytes / us / 1e3
        table.append(row | {"GB/s": f"{gbs:.0f}", "vs_read": f"{us / read:.2f}", "equal": equal})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    set_quick(quick)
    torch.manual_seed(0)
    table: list[dict] = []
    for vocab in VOCABS[:1] if quick else VOCABS:
        for rows in ROWS:
            time_top_k(vocab, rows, table)
            time_pick(vocab, rows, table)
    print(versions())
    show_table(table, "sampling", COLUMNS)


if __name__ == "__main__":
    main()
