"""Paged extend (prefill / chunked prefill) attention on the GPU: nanoserve vs torch SDPA,
causal, on the same K/V laid out contiguously; TFLOP/s of the causal work.

bf16, Llama-3-8B attention (32 query / 8 KV heads, head_dim 128) and Llama-3.2-1B (32/8/64),
block size 16, blocks scattered at random. Prefill: batch 1/8 x 512/2048/8192 new tokens.
Chunked prefill: 512 new tokens over 2048 / 8192 cached ones. Each provider is checked against
SDPA in float32 first. Timed eager and under CUDA-graph replay (the kernels without
the host's launch cost, which dominates the smallest shapes).
Usage: python3 benchmarks/bench_extend.py [--sweep]
(`--sweep`: nanoserve at fixed tile configs on a few shapes, beside SDPA; tuning data only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    num_input_sets,
    print_table,
    rel_err,
    time_eager,
    time_graph,
    versions,
    write_csv,
)
from plot import plot_rows  # noqa: E402

from nanoserve.kernels import paged_extend_attention, triton_extend  # noqa: E402

HQ, HKV, BS = 32, 8, 16
DTYPE = torch.bfloat16
# (batch, cached history, new tokens)
CASES = [(1, 0, 512), (1, 0, 2048), (1, 0, 8192), (8, 0, 512), (8, 0, 2048), (8, 0, 8192),
         (1, 2048, 512), (1, 8192, 512)]  # fmt: skip
HEAD_DIMS = [128, 64]
# (head_dim, batch, history, new) and (BLOCK_M, BLOCK_N, num_warps, num_stages) for --sweep
SWEEP_CASES = [(128, 1, 0, 2048), (128, 1, 0, 8192), (128, 1, 0, 512), (128, 1, 8192, 512),
               (64, 1, 0, 8192), (64, 1, 8192, 512)]  # fmt: skip
SWEEP_CONFIGS = {
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    64: [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 32, 4, 2)],
}


def causal_pairs(history: int, new: int) -> int:
    """(query, key) pairs a causal extend computes for one sequence."""
    return new * history + new * (new + 1) // 2


def make_set(batch: int, history: int, new: int, dim: int) -> dict:
    total = history + new
    blocks = batch * (-(-total // BS))
    kc = torch.randn(blocks + 8, BS, HKV, dim, device="cuda").to(DTYPE)
    vc = torch.randn_like(kc)
    bt = torch.randperm(blocks + 8, device="cuda")[:blocks].view(batch, -1).int().contiguous()
    sl = torch.full((batch,), total, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
    q = torch.randn(batch * new, HQ, dim, device="cuda").to(DTYPE)
    k = kc[bt.long()].view(batch, -1, HKV, dim)[:, :total].transpose(1, 2).contiguous()
    v = vc[bt.long()].view(batch, -1, HKV, dim)[:, :total].transpose(1, 2).contiguous()
    q4 = q.view(batch, new, HQ, dim).transpose(1, 2).contiguous()
    # bottom-right aligned causal mask for chunked prefill (new queries are the last rows)
    mask = None
    if history:
        mask = torch.ones(new, total, dtype=torch.bool, device="cuda").tril(history)
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, cu=cu, q4=q4, k=k, v=v, mask=mask)


def sdpa(s: dict, q4, k, v, gqa: bool = True):
    if s["mask"] is None:
        return F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q4, k, v, attn_mask=s["mask"], enable_gqa=gqa)


def packed(out4: torch.Tensor) -> torch.Tensor:
    """[B, Hq, n, D] -> [B * n, Hq, D]."""
    return out4.transpose(1, 2).flatten(0, 1)


def reference(s: dict) -> torch.Tensor:
    """SDPA in float32 (memory-efficient backend, so no score matrix is materialised)."""
    group = HQ // HKV
    k = s["k"].float().repeat_interleave(group, 1)
    v = s["v"].float().repeat_interleave(group, 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return packed(sdpa(s, s["q4"].float(), k, v, gqa=False))


def providers(s: dict) -> dict:
    def nanoserve():
        return paged_extend_attention(
            s["q"], s["kc"], s["vc"], s["bt"], s["sl"], s["cu"], check=False
        )

    def sdpa_contiguous():
        return packed(sdpa(s, s["q4"], s["k"], s["v"]))

    return {"nanoserve": nanoserve, "sdpa_contiguous": sdpa_contiguous}


def tflops(flops: int, us: float) -> float:
    return round(flops / (us * 1e-6) / 1e12, 1)


def case_name(dim: int, batch: int, history: int, new: int) -> str:
    return f"d{dim} {batch}x{new}" + (f"+{history}" if history else "")


def sweep() -> None:
    rows = []
    for dim, batch, history, new in SWEEP_CASES:
        kv_bytes = 2 * batch * (history + new) * HKV * dim * 2
        sets = [make_set(batch, history, new, dim) for _ in range(num_input_sets(kv_bytes, 4))]
        ref = reference(sets[0])
        flops = 4 * dim * HQ * batch * causal_pairs(history, new)
        shape = case_name(dim, batch, history, new)
        sdpa_us = time_eager([providers(s)["sdpa_contiguous"] for s in sets])
        rows.append(dict(shape=shape, config="sdpa", us=round(sdpa_us, 1),
                         TFLOPs=tflops(flops, sdpa_us), pct_sdpa=100))  # fmt: skip
        print(rows[-1], flush=True)
        for config in SWEEP_CONFIGS[dim]:

            def run(s, config=config, dim=dim):
                return triton_extend.paged_extend_attention_triton(
                    s["q"], s["kc"], s["vc"], s["bt"], s["sl"], s["cu"], scale=dim**-0.5,
                    sliding_window=None, softcap=None, config=config,
                )  # fmt: skip

            try:
                err = f"{rel_err(run(sets[0]), ref):.1e}"
                us = time_eager([lambda s=s: run(s) for s in sets])
            except Exception as e:  # e.g. out of shared memory for this tile
                rows.append(dict(shape=shape, config=str(config), err=str(e)[:60]))
                continue
            rows.append(dict(shape=shape, config=str(config), us=round(us, 1),
                             TFLOPs=tflops(flops, us),
                             pct_sdpa=round(100 * sdpa_us / us), err=err))  # fmt: skip
            print(rows[-1], flush=True)
        del sets, ref
        torch.cuda.empty_cache()
    write_csv(rows, "extend_sweep.csv")
    print_table(rows, ["shape", "config", "us", "TFLOPs", "pct_sdpa", "err"])


def tuned_configs() -> list[str]:
    """What autotune picked, per (family, head_dim, grid/length bucket, dtypes)."""
    return [f"{key[:3]}: {config}" for key, config in triton_extend.autotune_picks().items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="fixed-config sweep only")
    args = parser.parse_args()
    print(versions())
    if args.sweep:
        sweep()
        return
    rows = []
    for dim in HEAD_DIMS:
        for batch, history, new in CASES:
            kv_bytes = 2 * batch * (history + new) * HKV * dim * 2
            sets = [make_set(batch, history, new, dim) for _ in range(num_input_sets(kv_bytes, 4))]
            ref = reference(sets[0])
            flops = 4 * dim * HQ * batch * causal_pairs(history, new)
            shape = case_name(dim, batch, history, new)
            per_set = [providers(s) for s in sets]
            for name in per_set[0]:
                fns = [p[name] for p in per_set]
                err = rel_err(fns[0](), ref)
                us = time_eager(fns)
                graph_us = time_graph(fns)  # the kernels alone, without launch overhead
                rows.append(dict(kernel="extend", shape=shape, provider=name, err=f"{err:.1e}",
                                 us=round(us, 1), TFLOPs=tflops(flops, us),
                                 graph_us=round(graph_us, 1),
                                 graph_TFLOPs=tflops(flops, graph_us)))  # fmt: skip
            sdpa_row = next(r for r in rows if r["shape"] == shape and r["provider"] != "nanoserve")
            for r in rows:
                if r["shape"] == shape:
                    r["pct_sdpa"] = round(100 * r["TFLOPs"] / sdpa_row["TFLOPs"])
                    r["graph_pct_sdpa"] = round(100 * r["graph_TFLOPs"] / sdpa_row["graph_TFLOPs"])
            del sets, per_set, ref
            torch.cuda.empty_cache()
    write_csv(rows, "extend.csv")
    plot_rows(rows, x="shape", y="TFLOPs", name="extend.png",
              title="paged extend vs SDPA causal, bf16")  # fmt: skip
    print("\n".join(["autotune picked:", *tuned_configs()]))
    print_table(rows, ["shape", "provider", "err", "us", "TFLOPs", "pct_sdpa", "graph_us",
                       "graph_TFLOPs", "graph_pct_sdpa"])  # fmt: skip


if __name__ == "__main__":
    main()
