"""Paged decode attention on the GPU: nanoserve vs torch SDPA (contiguous K/V), a naive
gather-then-SDPA, and a pure read of the same bytes (the ceiling).

bf16, Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), block size 16, blocks
scattered at random. Usage: python3 benchmarks/bench_decode.py [--sweep] [--shapes 32x4096,...]
Prints a markdown table (median µs, eager and CUDA-graph replay); writes CSV under $OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    ceiling_us,
    num_input_sets,
    print_table,
    rel_err,
    time_eager,
    time_graph,
    versions,
    write_csv,
)

from nanoserve.kernels import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.triton_decode import paged_decode_attention_triton  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
SHAPES = [(32, 4096), (1, 8192), (1, 32768), (8, 8192), (32, 8192), (128, 512), (128, 8192)]
SWEEP_SHAPES = [(32, 4096), (1, 32768), (8, 8192), (128, 512)]


def kv_bytes(batch: int, ctx: int) -> int:
    return batch * ctx * HKV * D * 2 * 2


def make_set(batch: int, ctx: int) -> dict:
    """One input set: paged pools with scattered blocks plus the same K/V laid out contiguously."""
    used = batch * ctx // BS
    total = used + 64
    kc = torch.randn(total, BS, HKV, D, device="cuda").to(DTYPE)
    vc = torch.randn(total, BS, HKV, D, device="cuda").to(DTYPE)
    bt = torch.randperm(total, device="cuda")[:used].view(batch, ctx // BS).int().contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda").to(DTYPE)
    k_cont = kc[bt.long()].view(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    v_cont = vc[bt.long()].view(batch, ctx, HKV, D).transpose(1, 2).contiguous()
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, k_cont=k_cont, v_cont=v_cont)


def providers(s: dict) -> dict:
    batch, ctx = s["bt"].shape[0], s["bt"].shape[1] * BS
    q4 = s["q"].view(batch, HQ, 1, D)

    def nanoserve():
        return paged_decode_attention(s["q"], s["kc"], s["vc"], s["bt"], s["sl"], check=False)

    def sdpa():
        out = F.scaled_dot_product_attention(q4, s["k_cont"], s["v_cont"], enable_gqa=True)
        return out.view(batch, HQ, D)

    def gather_sdpa():
        idx = s["bt"].long()
        k = s["kc"][idx].view(batch, ctx, HKV, D).transpose(1, 2)
        v = s["vc"][idx].view(batch, ctx, HKV, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).view(batch, HQ, D)

    return {"nanoserve": nanoserve, "sdpa_contiguous": sdpa, "gather_sdpa": gather_sdpa}


def reference(s: dict) -> torch.Tensor:
    return paged_decode_attention_ref(
        s["q"].float(), s["kc"].float(), s["vc"].float(), s["bt"], s["sl"], check=False
    )


def bench_shape(batch: int, ctx: int) -> list[dict]:
    nbytes = kv_bytes(batch, ctx)
    sets = [make_set(batch, ctx) for _ in range(num_input_sets(nbytes))]
    ref = reference(sets[0])
    rows = []
    ceil_eager = ceiling_us(nbytes, len(sets), graph=False)
    ceil_graph = ceiling_us(nbytes, len(sets), graph=True)
    rows.append(dict(shape=f"{batch}x{ctx}", provider="pure_read_ceiling", err="",
                     eager_us=ceil_eager, graph_us=ceil_graph))  # fmt: skip
    per_set = [providers(s) for s in sets]
    for name in per_set[0]:
        fns = [p[name] for p in per_set]
        err = rel_err(fns[0](), ref)
        try:
            graph = time_graph(fns)
        except RuntimeError as e:  # a provider that cannot be captured
            print(f"{name} {batch}x{ctx}: no graph ({e})", file=sys.stderr)
            graph = float("nan")
        rows.append(dict(shape=f"{batch}x{ctx}", provider=name, err=f"{err:.1e}",
                         eager_us=time_eager(fns), graph_us=graph))  # fmt: skip
    sdpa = next(r for r in rows if r["provider"] == "sdpa_contiguous")
    for r in rows:
        r["GB/s"] = round(nbytes / (r["graph_us"] * 1e-6) / 1e9)
        r["%ceil"] = round(100 * ceil_graph / r["graph_us"], 1)
        r["vs_sdpa"] = round(r["graph_us"] / sdpa["graph_us"], 2)
        r["eager_us"] = round(r["eager_us"], 1)
        r["graph_us"] = round(r["graph_us"], 1)
    del sets
    torch.cuda.empty_cache()
    return rows


def sweep_shape(batch: int, ctx: int) -> list[dict]:
    """nanoserve alone over split counts and (BLOCK_N, warps, stages): tuning data."""
    nbytes = kv_bytes(batch, ctx)
    sets = [make_set(batch, ctx) for _ in range(num_input_sets(nbytes))]
    ref = reference(sets[0])
    rows = []
    variants = [(sp, None) for sp in (1, 2, 4, 8, 16, 32, 64)]
    variants += [(None, c) for c in ((32, 4, 2), (128, 4, 2), (64, 8, 2), (64, 4, 3), (64, 4, 1))]
    for splits, config in variants:
        fns = [
            lambda s=s, sp=splits, c=config: paged_decode_attention_triton(
                s["q"],
                s["kc"],
                s["vc"],
                s["bt"],
                s["sl"],
                scale=D**-0.5,
                sliding_window=None,
                softcap=None,
                num_splits=sp,
                config=c,
            )  # fmt: skip
            for s in sets
        ]
        err = rel_err(fns[0](), ref)
        us = time_graph(fns)
        rows.append(dict(shape=f"{batch}x{ctx}", splits=splits or "auto",
                         config=config or "default", graph_us=round(us, 1),
                         GBps=round(nbytes / (us * 1e-6) / 1e9), err=f"{err:.1e}"))  # fmt: skip
    del sets
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep splits and configs")
    parser.add_argument("--shapes", default=None, help="e.g. 32x4096,1x32768")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    print(versions())
    if args.sweep:
        sweep = [r for b, c in SWEEP_SHAPES for r in sweep_shape(b, c)]
        write_csv(sweep, "decode_sweep.csv")
        print_table(sweep, list(sweep[0]))
    rows = [r for b, c in shapes for r in bench_shape(b, c)]
    write_csv(rows, "bench_decode.csv")
    cols = ["shape", "provider", "eager_us", "graph_us", "GB/s", "%ceil", "vs_sdpa", "err"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
