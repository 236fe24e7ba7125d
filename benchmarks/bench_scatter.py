"""Slot scatter on the GPU: nanoserve's Triton kernel vs torch indexing, against a
device-to-device copy of the same bytes (the ceiling for a write-heavy kernel).

bf16, 8 KV heads x head_dim 128 (Llama-3-8B) and 8 x 64 (Llama-3.2-1B); 32 tokens (one decode
step of a batch of 32) and 8192 tokens (a prefill), slots scattered at random over the pool.
Bytes = K and V rows read once and written once. Timed with triton.testing, eager
(``do_bench``) and under CUDA-graph replay (``do_bench_cudagraph``); ``perf_report`` prints
GB/s per provider against the tokens written and writes scatter_d<dim>.csv/.png under $OUT;
then the table RESULTS.md uses is printed and written to $OUT/scatter.csv and plotted (GB/s
against the shape) as $OUT/scatter.png. ``--quick``: the same four shapes, shorter timings.
Usage: python3 benchmarks/bench_scatter.py [--quick] [--sweep] (`--sweep`: the Triton kernel
at several tile sizes and warps; tuning data only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_scatter")

import triton.testing  # noqa: E402
from harness import (  # noqa: E402
    num_input_sets,
    out_dir,
    set_quick,
    show_table,
    time_eager,
    time_graph,
    versions,
)
from plot import plot_rows  # noqa: E402

from nanoserve.kernels import slot_scatter, slot_scatter_ref  # noqa: E402
from nanoserve.kernels.triton_scatter import slot_scatter_triton  # noqa: E402

BS = 16
DTYPE = torch.bfloat16
POOL_BLOCKS = 4096
SHAPES = [(32, 8, 128), (8192, 8, 128), (32, 8, 64), (8192, 8, 64)]
SWEEP_CONFIGS = [(e, w) for e in (2048, 4096, 8192, 16384) for w in (4, 8)]
PROVIDERS = ["device_copy_ceiling", "nanoserve", "torch_index"]
STYLES = [("black", "--"), ("C0", "-"), ("C2", "-")]
COLUMNS = ["shape", "provider", "check", "eager_us", "graph_us", "GB/s", "vs_copy", "vs_torch"]


def make_set(tokens: int, heads: int, dim: int) -> dict:
    pool_k = torch.randn(POOL_BLOCKS, BS, heads, dim, device="cuda").to(DTYPE)
    pool_v = torch.randn_like(pool_k)
    slots = torch.randperm(POOL_BLOCKS * BS, device="cuda")[:tokens]
    key = torch.randn(tokens, heads, dim, device="cuda").to(DTYPE)
    value = torch.randn_like(key)
    src = torch.cat([key.flatten(), value.flatten()])
    return dict(
        k=key, v=value, kc=pool_k, vc=pool_v, slots=slots, src=src, dst=torch.empty_like(src)
    )


def providers(s: dict) -> dict:
    def nanoserve():
        slot_scatter(s["k"], s["v"], s["kc"], s["vc"], s["slots"], check=False)

    def torch_index():
        heads, dim = s["kc"].shape[2:]
        s["kc"].view(-1, heads, dim)[s["slots"]] = s["k"]
        s["vc"].view(-1, heads, dim)[s["slots"]] = s["v"]

    def copy():
        s["dst"].copy_(s["src"])

    return {"device_copy_ceiling": copy, "nanoserve": nanoserve, "torch_index": torch_index}


def check(s: dict) -> str:
    """Both writers produce exactly the reference pools."""
    expected_k, expected_v = s["kc"].clone(), s["vc"].clone()
    slot_scatter_ref(s["k"], s["v"], expected_k, expected_v, s["slots"])
    got_k, got_v = s["kc"].clone(), s["vc"].clone()
    slot_scatter(s["k"], s["v"], got_k, got_v, s["slots"], backend="triton")
    exact = torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    return "exact" if exact else "MISMATCH"


def sweep() -> None:
    rows = []
    for tokens, heads, dim in SHAPES:
        nbytes = 2 * 2 * tokens * heads * dim * 2
        sets = [make_set(tokens, heads, dim) for _ in range(num_input_sets(nbytes, 4))]
        shape = f"{tokens}tok x{heads}x{dim}"
        copy_us = time_graph([providers(s)["device_copy_ceiling"] for s in sets]).median
        torch_us = time_graph([providers(s)["torch_index"] for s in sets]).median
        for config in SWEEP_CONFIGS:

            def run(s, config=config):
                slot_scatter_triton(s["k"], s["v"], s["kc"], s["vc"], s["slots"], config=config)

            us = time_graph([lambda s=s: run(s) for s in sets]).median
            rows.append(dict(shape=shape, config=str(config), graph_us=round(us, 2),
                             copy_us=round(copy_us, 2), torch_us=round(torch_us, 2),
                             vs_copy=round(us / copy_us, 2),
                             vs_torch=round(us / torch_us, 2)))  # fmt: skip
            print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    show_table(rows, "scatter_sweep.csv")


def nbytes_of(tokens: int, heads: int, dim: int) -> int:
    """K and V rows, read once and written once, bf16."""
    return 2 * 2 * tokens * heads * dim * 2


class Writes:
    """What ``perf_report`` measures: one (shape, provider) point at a time; the input sets
    of a shape are built (and checked) once for its providers. Every point appends its
    RESULTS row to ``rows``."""

    def __init__(self):
        self.rows: list[dict] = []
        self.key = None
        self.current: dict = {}

    def _load(self, tokens: int, heads: int, dim: int) -> dict:
        if self.key != (tokens, heads, dim):
            self.current = {}
            torch.cuda.empty_cache()
            count = num_input_sets(nbytes_of(tokens, heads, dim), 4)
            sets = [make_set(tokens, heads, dim) for _ in range(count)]
            status = check(sets[0])
            self.current = dict(per_set=[providers(s) for s in sets], check=status)
            self.key = (tokens, heads, dim)
        return self.current

    def __call__(self, tokens: int, provider: str, heads: int, dim: int):
        """GB/s of ``provider`` writing ``tokens`` rows: (median, at p80, at p20 time)."""
        data = self._load(tokens, heads, dim)
        fns = [p[provider] for p in data["per_set"]]
        eager, graph = time_eager(fns), time_graph(fns)
        nbytes = nbytes_of(tokens, heads, dim)
        self.rows.append(dict(kernel="slot_scatter", shape=f"{tokens}tok x{heads}x{dim}",
                              provider=provider,
                              check=data["check"] if provider == "nanoserve" else "",
                              eager_us=round(eager.median, 2), graph_us=round(graph.median, 2),
                              **{"GB/s": round(nbytes / (graph.median * 1e-6) / 1e9)}))  # fmt: skip
        return tuple(nbytes / (us * 1e-6) / 1e9 for us in (graph.median, graph.p80, graph.p20))


def finish_rows(rows: list[dict]) -> list[dict]:
    """Each row's graph time over the device copy's and torch indexing's of its shape."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        same = [r for r in rows if r["shape"] == shape]
        by = {r["provider"]: r["graph_us"] for r in same}
        for r in same:
            r["vs_copy"] = round(r["graph_us"] / by["device_copy_ceiling"], 2)
            r["vs_torch"] = round(r["graph_us"] / by["torch_index"], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="tile/warps sweep only")
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    args = parser.parse_args()
    set_quick(args.quick)
    print(versions())
    if args.sweep:
        sweep()
        return
    measure = Writes()
    for heads, dim in dict.fromkeys((h, d) for _, h, d in SHAPES):
        report = triton.testing.Benchmark(
            x_names=["tokens"],
            x_vals=[t for t, h, d in SHAPES if (h, d) == (heads, dim)],
            x_log=True,
            line_arg="provider",
            line_vals=PROVIDERS,
            line_names=PROVIDERS,
            styles=STYLES,
            ylabel="GB/s",
            xlabel=f"tokens written ({heads} KV heads x {dim}, bf16, graph replay)",
            plot_name=f"scatter_d{dim}",
            args={"heads": heads, "dim": dim},
        )
        triton.testing.perf_report(report)(measure).run(print_data=True, save_path=out_dir())
    rows = finish_rows(measure.rows)
    show_table(rows, "scatter.csv", COLUMNS)
    title = "slot scatter, bf16, graph replay: GB/s"
    plot_rows(rows, x="shape", y="GB/s", name="scatter.png", title=title, ceiling=PROVIDERS[0])


if __name__ == "__main__":
    main()
