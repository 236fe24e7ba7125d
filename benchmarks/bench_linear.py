"""A decode step's projections at 1 to 64 rows: nanoserve's small-batch linear kernel beside
torch (cuBLAS) and a pure read of the weights.

The err column is each output's relative error against the float64 reference rounded to
bf16 (cuBLAS's and the kernel's last-bit differences). Shapes are the Llama-3.2-1B and
Llama-3.1-8B layers (bf16): q/k/v fused into one launch
(torch: three linears), o, gate/up with silu and the product fused (torch: two linears,
silu, mul), down, and the 1B lm_head. Timed under CUDA-graph replay with weight sets rotated
past the L2 (a decode step reads each weight once). ``--sweep`` also times a grid of tile
configs and prints the best few per shape. ``--mlp`` times whole gated MLPs instead (Llama
1B, 3B, 8B, SmolLM2 shapes): ``fused_mlp`` in one launch and in two, the two ``small_batch_linear``
launches (and the K shares' sum) the decode step ran before, and torch's eager ops.
Usage: python3 benchmarks/bench_linear.py [--quick] [--sweep] [--mlp]; writes
$OUT/linear.csv (``--mlp``: $OUT/mlp.csv).
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

require_cuda("bench_linear")

from harness import (  # noqa: E402
    ceiling,
    num_input_sets,
    rel_err,
    set_quick,
    show_table,
    time_graph,
    versions,
)

from nanoserve.kernels.fused_mlp import (  # noqa: E402
    PROGRAMS_PER_SM,
    choose_config,
    fused_mlp,
    fused_mlp_ref,
    new_barrier,
)
from nanoserve.kernels.small_batch_linear import (  # noqa: E402
    LinearConfig,
    small_batch_linear,
    small_batch_linear_ref,
)

# (name, K, output sizes, gated)
CASES = [
    ("1B qkv", 2048, (2048, 512, 512), False),
    ("1B o", 2048, (2048,), False),
    ("1B gate_up", 2048, (8192, 8192), True),
    ("1B down", 8192, (2048,), False),
    ("1B lm_head", 2048, (128256,), False),
    ("8B qkv", 4096, (4096, 1024, 1024), False),
    ("8B gate_up", 4096, (14336, 14336), True),
    ("8B down", 14336, (4096,), False),
]
COLUMNS = ["shape", "rows", "provider", "us", "GB/s", "vs_read", "err"]
# (name, K, N (gate / up outputs), H (down outputs))
MLP_CASES = [
    ("1B mlp", 2048, 8192, 2048),
    ("3B mlp", 3072, 8192, 3072),
    ("8B mlp", 4096, 14336, 4096),
    ("SmolLM2 mlp", 576, 1536, 576),
]


def torch_fn(x, weights, gated):
    if gated:
        g, u = weights
        return lambda: torch.nn.functional.silu(x @ g.T) * (x @ u.T)
    return lambda: [torch.nn.functional.linear(x, w) for w in weights]


def sweep_configs():
    for block_n, block_k, split in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8)):
        yield LinearConfig(block_n, block_k, split, num_warps=4, num_stages=4)


def kernel_fns(x, weight_sets, gated, config=None):
    return [
        lambda ws=ws: small_batch_linear(x, ws, gated=gated, config=config, weights_ready=True)
        for ws in weight_sets
    ]


def time_config(x, weight_sets, gated, cfg) -> float | None:
    """µs of one config, or None where its tiles do not fit the shared memory."""
    from triton.runtime.errors import OutOfResources

    try:
        small_batch_linear(
            x, weight_sets[0], gated=gated, config=cfg, weights_ready=True
        )  # compiles outside capture
    except OutOfResources:
        return None
    return time_graph(kernel_fns(x, weight_sets, gated, cfg)).median


def time_case(name, k, sizes, gated, sweep, rows_out, best) -> None:
    nbytes = sum(n * k * 2 for n in sizes)
    sets = num_input_sets(nbytes, max_sets=32)
    weight_sets = [
        [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for n in sizes]
        for _ in range(sets)
    ]
    read = ceiling(nbytes, sets, graph=True).median
    for rows in (1, 4, 16, 32, 64):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = small_batch_linear_ref(x, weight_sets[0], gated=gated)
        out = small_batch_linear(x, weight_sets[0], gated=gated)
        stock = torch_fn(x, weight_sets[0], gated)()
        stock = stock if gated else torch.cat(stock, dim=-1)
        timings = [
            ("torch", time_graph([torch_fn(x, ws, gated) for ws in weight_sets]).median,
             f"{rel_err(stock, ref):.1e}"),
            ("nanoserve", time_graph(kernel_fns(x, weight_sets, gated)).median,
             f"{rel_err(out, ref):.1e}"),
            ("read", read, ""),
        ]  # fmt: skip
        for provider, us, err in timings:
            rows_out.append({"shape": name, "rows": rows, "provider": provider,
                             "us": f"{us:.2f}", "GB/s": f"{nbytes / us / 1e3:.0f}",
                             "vs_read": f"{us / read:.2f}", "err": err})  # fmt: skip
        if sweep and rows in (1, 16, 64) and "lm_head" not in name:
            timed = sorted(
                (t, cfg) for cfg in sweep_configs()
                if (t := time_config(x, weight_sets, gated, cfg)) is not None
            )  # fmt: skip
            for us, cfg in timed[:3]:
                best.append(f"{name} rows {rows}: {us:.2f} us ({us / read:.2f}x read) {cfg}")
        print(f"{name} rows {rows} done", file=sys.stderr, flush=True)


def mlp_providers(x, weight_sets, sweep: bool) -> dict:
    """name -> (one call per weight set, its output on the first set)."""
    cfg = choose_config(weight_sets[0][0].shape[0], weight_sets[0][2].shape[0], x.device)
    barriers = [new_barrier(x.device, ws[2].shape[0]) for ws in weight_sets]

    def fused(config):
        fns = [
            lambda ws=ws, b=b: fused_mlp(x, *ws, config=config, barrier=b, weights_ready=True)
            for ws, b in zip(weight_sets, barriers, strict=True)
        ]
        return fns, fns[0]()

    def two_kernels(ws):
        hidden = small_batch_linear(x, ws[:2], gated=True, weights_ready=True)
        return small_batch_linear(hidden, ws[2:], weights_ready=True)

    def eager(ws):
        g, u, d = ws
        return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T

    providers = {
        "fused_mlp": fused(cfg),
        "fused_mlp, two launches": fused(cfg._replace(one_launch=False)),
        "small_batch_linear x2": (
            [lambda ws=ws: two_kernels(ws) for ws in weight_sets],
            two_kernels(weight_sets[0]),
        ),
        "torch": ([lambda ws=ws: eager(ws) for ws in weight_sets], eager(weight_sets[0])),
    }
    if sweep:
        sms = cfg.programs // PROGRAMS_PER_SM
        grid = itertools.product((2, 3, 4), (3, 4), (256,), (2, 4, 8))
        for per_sm, stages, down_k, shares in grid:
            config = cfg._replace(
                programs=per_sm * sms, num_stages=stages, down_k=down_k, shares=shares
            )
            providers[f"fused {per_sm}/SM {stages}st k{down_k} {shares}sh"] = fused(config)
    return providers


def time_mlp_case(name, k, n, h, sweep, rows_out) -> None:
    """Each provider at 1, 4 and 16 rows (the sweep's configs at 1 row) beside the read."""
    nbytes = (2 * n * k + h * n) * 2
    sets = num_input_sets(nbytes, max_sets=32)
    weight_sets = [
        [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(2)]
        + [torch.randn(h, n, device="cuda", dtype=torch.bfloat16) / n**0.5]
        for _ in range(sets)
    ]
    read = ceiling(nbytes, sets, graph=True).median
    for rows in (1, 4, 16):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = fused_mlp_ref(x, *weight_sets[0])
        timed = [
            (provider, time_graph(fns).median, f"{rel_err(out, ref):.1e}")
            for provider, (fns, out) in mlp_providers(x, weight_sets, sweep and rows == 1).items()
        ]
        for provider, us, err in [*timed, ("read", read, "")]:
            rows_out.append({"shape": name, "rows": rows, "provider": provider,
                             "us": f"{us:.2f}", "GB/s": f"{nbytes / us / 1e3:.0f}",
                             "vs_read": f"{us / read:.2f}", "err": err})  # fmt: skip
        print(f"{name} rows {rows} done", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--mlp", action="store_true")
    parser.add_argument("--shapes", help="--mlp: names of MLP_CASES, comma-separated")
    args = parser.parse_args()
    set_quick(args.quick)
    torch.manual_seed(0)
    rows_out, best = [], []
    if args.mlp:
        names = args.shapes.split(",") if args.shapes else [c[0] for c in MLP_CASES]
        for name, k, n, h in [c for c in MLP_CASES if c[0] in names]:
            time_mlp_case(name, k, n, h, args.sweep, rows_out)
        print(versions())
        show_table(rows_out, "mlp", COLUMNS)
        return
    for name, k, sizes, gated in CASES:
        time_case(name, k, sizes, gated, args.sweep, rows_out, best)
    print(versions())
    for line in best:
        print(line)
    show_table(rows_out, "linear", COLUMNS)


if __name__ == "__main__":
    main()
