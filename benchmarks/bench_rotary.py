"""The rotary embedding as a decode step runs it: nanoserve's kernel (q and k in one launch)
beside transformers' apply_rotary_pos_emb (eager, about ten kernels) and a pure read of the
bytes it moves (q, k, cos and sin read, q and k written), bf16, on q and k as the attention
module hands them over (transposed views of the projections' output), under CUDA-graph
replay with inputs rotated past the L2.
Usage: python3 benchmarks/bench_rotary.py [--quick]; writes $OUT/rotary.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_rotary")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    set_quick,
    show_table,
    time_graph,
    versions,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from nanoserve.kernels.rotary import apply_rotary  # noqa: E402

# (name, q heads, kv heads, head_dim)
SHAPES = (("1B", 32, 8, 64), ("8B", 32, 8, 128), ("Qwen2.5-7B", 28, 4, 128), ("d256", 16, 8, 256))
ROWS = (1, 16, 128)
COLUMNS = ["shape", "rows", "provider", "us", "vs_read", "equal"]


def step_inputs(rows: int, q_heads: int, kv_heads: int, dim: int):
    """q and k [rows, H, 1, D] as views of one projection output; cos, sin [rows, 1, D]."""
    fused = torch.randn(rows, 1, (q_heads + 2 * kv_heads) * dim, device="cuda").bfloat16()
    q = fused[..., : q_heads * dim].view(rows, 1, q_heads, dim).transpose(1, 2)
    k = fused[..., q_heads * dim : (q_heads + kv_heads) * dim].view(rows, 1, kv_heads, dim)
    angles = torch.rand(rows, 1, dim, device="cuda") * 100
    return q, k.transpose(1, 2), angles.cos().bfloat16(), angles.sin().bfloat16()


def time_shape(name: str, q_heads: int, kv_heads: int, dim: int, table: list[dict]) -> None:
    for rows in ROWS:
        nbytes = 2 * (2 * rows * (q_heads + kv_heads) * dim + 2 * rows * dim)
        sets = num_input_sets(nbytes, max_sets=32)
        inputs = [step_inputs(rows, q_heads, kv_heads, dim) for _ in range(sets)]
        pairs = zip(apply_rotary(*inputs[0]), apply_rotary_pos_emb(*inputs[0]), strict=True)
        equal = all(torch.equal(a, b) for a, b in pairs)
        timings = [
            ("transformers", time_graph([lambda t=t: apply_rotary_pos_emb(*t) for t in inputs])),
            ("nanoserve", time_graph([lambda t=t: apply_rotary(*t) for t in inputs])),
            ("read", ceiling(nbytes, sets, graph=True)),
        ]
        read = timings[-1][1].median
        for provider, timing in timings:
            row = {"shape": name, "rows": rows, "provider": provider, "us": f"{timing.median:.2f}"}
            row |= {"vs_read": f"{timing.median / read:.2f}"}
            table.append(row | {"equal": str(equal) if provider == "nanoserve" else ""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    set_quick(parser.parse_args().quick)
    torch.manual_seed(0)
    table: list[dict] = []
    for shape in SHAPES:
        time_shape(*shape, table)
    print(versions())
    show_table(table, "rotary", COLUMNS)


if __name__ == "__main__":
    main()
