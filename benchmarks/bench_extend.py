"""Paged extend (prefill / chunked prefill) attention on the GPU: nanoserve vs torch SDPA,
causal, on the same K/V laid out contiguously; TFLOP/s of the causal work.

bf16, Llama-3-8B attention (32 query / 8 KV heads, head_dim 128) and Llama-3.2-1B (32/8/64),
block size 16, blocks scattered at random. Prefill: batch 1/8 x 512/2048/8192 new tokens.
Chunked prefill: 512 new tokens over 2048 / 8192 cached ones. Each provider is checked against
SDPA in float32 first. Timed with triton.testing, eager (``do_bench``) and under CUDA-graph
replay (``do_bench_cudagraph``: the kernels without the host's launch cost, which dominates
the smallest shapes). ``triton.testing.perf_report`` prints eager TFLOP/s per provider and
writes extend_d<dim>_b<batch>.csv/.png (against the new tokens) and extend_d<dim>_chunked
(against the cached history) under $OUT; then the table RESULTS.md uses is printed and
written to $OUT/extend.csv and plotted (TFLOP/s against the case) as $OUT/extend.png.
``--quick``: one short and one long prefill at batch 1, one at batch 8 and one chunked prefill
(QUICK_CASES), shorter timings. Errors are against a reference kept on the host (see
harness.Reference).
Usage: python3 benchmarks/bench_extend.py [--quick] [--sweep]
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

from harness import require_cuda  # noqa: E402

require_cuda("bench_extend")

import triton.testing  # noqa: E402
from harness import (  # noqa: E402
    Reference,
    num_input_sets,
    out_dir,
    quick,
    rel_err,
    set_quick,
    show_table,
    time_eager,
    time_graph,
    versions,
)
from plot import plot_rows  # noqa: E402

from nanoserve.kernels import paged_extend_attention, triton_extend  # noqa: E402

HQ, HKV, BS = 32, 8, 16
DTYPE = torch.bfloat16
# (batch, cached history, new tokens)
CASES = [(1, 0, 512), (1, 0, 2048), (1, 0, 8192), (8, 0, 512), (8, 0, 2048), (8, 0, 8192),
         (1, 2048, 512), (1, 8192, 512)]  # fmt: skip
QUICK_CASES = [(1, 0, 512), (1, 0, 8192), (8, 0, 2048), (1, 8192, 512)]
HEAD_DIMS = [128, 64]
PROVIDERS = ["nanoserve", "sdpa_contiguous"]
COLUMNS = ["shape", "provider", "err", "us", "TFLOPs", "pct_sdpa", "graph_us", "graph_TFLOPs"]
COLUMNS += ["graph_pct_sdpa"]
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
        sdpa_us = time_eager([providers(s)["sdpa_contiguous"] for s in sets]).median
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
                us = time_eager([lambda s=s: run(s) for s in sets]).median
            except Exception as e:  # e.g. out of shared memory for this tile
                rows.append(dict(shape=shape, config=str(config), err=str(e)[:60]))
                continue
            rows.append(dict(shape=shape, config=str(config), us=round(us, 1),
                             TFLOPs=tflops(flops, us),
                             pct_sdpa=round(100 * sdpa_us / us), err=err))  # fmt: skip
            print(rows[-1], flush=True)
        del sets, ref
        torch.cuda.empty_cache()
    show_table(rows, "extend_sweep.csv", ["shape", "config", "us", "TFLOPs", "pct_sdpa", "err"])


def tuned_configs() -> list[str]:
    """What autotune picked, per (family, head_dim, grid/length bucket, dtypes)."""
    return [f"{key[:3]}: {config}" for key, config in triton_extend.autotune_picks().items()]


class Cases:
    """What ``perf_report`` measures: one (case, provider) point at a time; the input sets of
    a case are built once for its providers. Every point appends its RESULTS row to
    ``rows``."""

    def __init__(self):
        self.rows: list[dict] = []
        self.key = None
        self.current: dict = {}

    def _load(self, dim: int, batch: int, history: int, new: int) -> dict:
        if self.key != (dim, batch, history, new):
            self.current = {}
            torch.cuda.empty_cache()
            kv_bytes = 2 * batch * (history + new) * HKV * dim * 2
            sets = [make_set(batch, history, new, dim) for _ in range(num_input_sets(kv_bytes, 4))]
            per_set = [providers(s) for s in sets]
            inputs = {name: sets[0][name] for name in ("q", "kc", "vc", "bt", "k", "v")}
            self.current = dict(per_set=per_set, ref=Reference(reference(sets[0]), inputs))
            self.key = (dim, batch, history, new)
        return self.current

    def __call__(self, provider: str, dim: int, batch: int, history: int, new: int):
        """Eager TFLOP/s of ``provider`` on the case: (median, at p80, at p20 time)."""
        data = self._load(dim, batch, history, new)
        fns = [p[provider] for p in data["per_set"]]
        flops = 4 * dim * HQ * batch * causal_pairs(history, new)
        err = data["ref"].err(fns[0]())
        eager = time_eager(fns)
        graph = time_graph(fns).median  # the kernels alone, without launch overhead
        self.rows.append(dict(kernel="extend", shape=case_name(dim, batch, history, new),
                              provider=provider, err=err, us=round(eager.median, 1),
                              TFLOPs=tflops(flops, eager.median), graph_us=round(graph, 1),
                              graph_TFLOPs=tflops(flops, graph)))  # fmt: skip
        return tuple(flops / (us * 1e-6) / 1e12 for us in (eager.median, eager.p80, eager.p20))


def finish_rows(rows: list[dict]) -> list[dict]:
    """Each row's TFLOP/s as a percentage of SDPA's on the same case, eager and graph."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        case = [r for r in rows if r["shape"] == shape]
        sdpa_row = next(r for r in case if r["provider"] == "sdpa_contiguous")
        for r in case:
            r["pct_sdpa"] = round(100 * sdpa_row["us"] / r["us"])  # same work: time ratio
            r["graph_pct_sdpa"] = round(100 * sdpa_row["graph_us"] / r["graph_us"])
    return rows


def reports(dim: int) -> list:
    """The head dim's perf_report benchmarks: prefill per batch against the new tokens, and
    chunked prefill against the cached history."""
    out = []
    groups: dict[tuple, list[int]] = {}
    for batch, history, new in QUICK_CASES if quick() else CASES:
        if history:
            groups.setdefault(("history", batch, new), []).append(history)
        else:
            groups.setdefault(("new", batch, 0), []).append(new)
    for (x_name, batch, fixed), x_vals in groups.items():
        chunked = x_name == "history"
        name = f"extend_d{dim}_" + (f"chunked_b{batch}_{fixed}" if chunked else f"b{batch}")
        args = dict(dim=dim, batch=batch, **({"new": fixed} if chunked else {"history": 0}))
        what = f"{fixed} new tokens over this history" if chunked else "new tokens, no history"
        out.append(
            triton.testing.Benchmark(
                x_names=[x_name],
                x_vals=x_vals,
                x_log=True,
                line_arg="provider",
                line_vals=PROVIDERS,
                line_names=PROVIDERS,
                ylabel="TFLOP/s (eager)",
                xlabel=f"{what} (batch {batch}, head_dim {dim}, bf16, causal)",
                plot_name=name,
                args=args,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="fixed-config sweep only")
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter timings")
    args = parser.parse_args()
    set_quick(args.quick)
    print(versions())
    if args.sweep:
        sweep()
        return
    measure = Cases()
    for dim in HEAD_DIMS:
        benchmarks = reports(dim)
        triton.testing.perf_report(benchmarks)(measure).run(print_data=True, save_path=out_dir())
    print("\n".join(["autotune picked:", *tuned_configs()]))
    rows = finish_rows(measure.rows)
    show_table(rows, "extend.csv", COLUMNS)
    plot_rows(rows, x="shape", y="TFLOPs", name="extend.png",
              title="paged extend (causal), bf16, eager: TFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
