"""RMSNorm as a decode step runs it: nanoserve's kernel beside transformers' LlamaRMSNorm
(eager, about seven kernels) and a pure read of the bytes the norm moves (x read, out
written), bf16, under CUDA-graph replay with inputs rotated past the L2.
Usage: python3 benchmarks/bench_rms_norm.py [--quick]; writes $OUT/rms_norm.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_rms_norm")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    rel_err,
    set_quick,
    show_table,
    time_graph,
    versions,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from nanoserve.kernels.rms_norm import rms_norm  # noqa: E402

WIDTHS = (576, 2048, 4096, 8192)
ROWS = (1, 16, 256)
COLUMNS = ["width", "rows", "provider", "us", "vs_read", "err"]


def time_width(width: int, table: list[dict]) -> None:
    module = LlamaRMSNorm(width, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        module.weight.normal_()
    weight = module.weight.detach()
    for rows in ROWS:
        nbytes = 2 * rows * width * 2
        sets = num_input_sets(nbytes, max_sets=32)
        xs = [torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        with torch.no_grad():
            stock = module(xs[0])
            ours = [lambda x=x: rms_norm(x, weight, 1e-5) for x in xs]
            timings = [
                ("transformers", time_graph([lambda x=x: module(x) for x in xs]).median, ""),
                ("nanoserve", time_graph(ours).median,
                 f"{rel_err(ours[0](), stock):.1e}"),
                ("read", ceiling(nbytes, sets, graph=True).median, ""),
            ]  # fmt: skip
        read = timings[-1][1]
        for provider, us, err in timings:
            row = {"width": width, "rows": rows, "provider": provider}
            table.append(row | {"us": f"{us:.2f}", "vs_read": f"{us / read:.2f}", "err": err})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    set_quick(parser.parse_args().quick)
    torch.manual_seed(0)
    table: list[dict] = []
    for width in WIDTHS:
        time_width(width, table)
    print(versions())
    show_table(table, "rms_norm", COLUMNS)


if __name__ == "__main__":
    main()
