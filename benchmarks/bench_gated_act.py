"""A gated MLP's activation as a prefill runs it: nanoserve's ``silu_mul`` (one launch) beside
eager ``F.silu(gate) * up`` (two: the SiLU written out, then the product) and a pure read of
the bytes the launch moves (gate and up read, the product written: three tensors), bf16,
under CUDA-graph replay with inputs rotated past the L2. ``equal``: the fraction of outputs
bit-equal to eager's.
Usage: python3 benchmarks/bench_gated_act.py [--quick]; writes $OUT/gated_act.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_gated_act")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    set_quick,
    show_table,
    time_graph,
    versions,
)

from nanoserve.kernels.gated_act import silu_mul  # noqa: E402

WIDTHS = (8192, 14336)  # Llama-3.2-1B's and Llama-3.1-8B's intermediate sizes
ROWS = (16, 512, 4096)
COLUMNS = ["width", "rows", "provider", "us", "GB/s", "vs_read", "equal"]


def eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def time_width(width: int, table: list[dict]) -> None:
    for rows in ROWS:
        nbytes = 3 * rows * width * 2
        sets = num_input_sets(nbytes, max_sets=16)
        pairs = [
            (6 * torch.randn(rows, width, device="cuda"), torch.randn(rows, width, device="cuda"))
            for _ in range(sets)
        ]
        pairs = [(g.bfloat16(), u.bfloat16()) for g, u in pairs]
        equal = (silu_mul(*pairs[0]) == eager(*pairs[0])).float().mean().item()
        timings = [
            ("eager", time_graph([lambda p=p: eager(*p) for p in pairs]).median, ""),
            ("nanoserve", time_graph([lambda p=p: silu_mul(*p) for p in pairs]).median,
             f"{equal:.6f}"),
            ("read", ceiling(nbytes, sets, graph=True).median, ""),
        ]  # fmt: skip
        read = timings[-1][1]
        for provider, us, eq in timings:
            row = {"width": width, "rows": rows, "provider": provider, "us": f"{us:.2f}"}
            gbs = nbytes / us / 1e3
            table.append(row | {"GB/s": f"{gbs:.0f}", "vs_read": f"{us / read:.2f}", "equal": eq})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    set_quick(parser.parse_args().quick)
    torch.manual_seed(0)
    table: list[dict] = []
    for width in WIDTHS:
        time_width(width, table)
    print(versions())
    show_table(table, "gated_act", COLUMNS)


if __name__ == "__main__":
    main()
