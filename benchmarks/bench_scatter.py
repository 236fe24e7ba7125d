"""Slot scatter on the GPU: nanoserve's Triton kernel vs torch indexing, against a
device-to-device copy of the same bytes (the ceiling for a write-heavy kernel).

bf16, 8 KV heads x head_dim 128 (Llama-3-8B) and 8 x 64 (Llama-3.2-1B); 32 tokens (one decode
step of a batch of 32) and 8192 tokens (a prefill), slots scattered at random over the pool.
Bytes = K and V rows read once and written once. Usage: python3 benchmarks/bench_scatter.py
[--sweep] (`--sweep`: the Triton kernel at several tile sizes and warps; tuning data only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import num_input_sets, print_table, time_eager, time_graph, versions, write_csv  # noqa: E402
from plot import plot_rows  # noqa: E402

from nanoserve.kernels import slot_scatter, slot_scatter_ref  # noqa: E402
from nanoserve.kernels.triton_scatter import slot_scatter_triton  # noqa: E402

BS = 16
DTYPE = torch.bfloat16
POOL_BLOCKS = 4096
SHAPES = [(32, 8, 128), (8192, 8, 128), (32, 8, 64), (8192, 8, 64)]
SWEEP_CONFIGS = [(e, w) for e in (2048, 4096, 8192, 16384) for w in (4, 8)]


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
        copy_us = time_graph([providers(s)["device_copy_ceiling"] for s in sets])
        torch_us = time_graph([providers(s)["torch_index"] for s in sets])
        for config in SWEEP_CONFIGS:

            def run(s, config=config):
                slot_scatter_triton(s["k"], s["v"], s["kc"], s["vc"], s["slots"], config=config)

            us = time_graph([lambda s=s: run(s) for s in sets])
            rows.append(dict(shape=shape, config=str(config), graph_us=round(us, 2),
                             copy_us=round(copy_us, 2), torch_us=round(torch_us, 2),
                             vs_copy=round(us / copy_us, 2),
                             vs_torch=round(us / torch_us, 2)))  # fmt: skip
            print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    write_csv(rows, "scatter_sweep.csv")
    print_table(rows, list(rows[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="tile/warps sweep only")
    args = parser.parse_args()
    print(versions())
    if args.sweep:
        sweep()
        return
    rows = []
    for tokens, heads, dim in SHAPES:
        nbytes = 2 * 2 * tokens * heads * dim * 2  # K and V, read + write, bf16
        sets = [make_set(tokens, heads, dim) for _ in range(num_input_sets(nbytes, 4))]
        status = check(sets[0])
        per_set = [providers(s) for s in sets]
        shape = f"{tokens}tok x{heads}x{dim}"
        for name in per_set[0]:
            fns = [p[name] for p in per_set]
            eager, graph = time_eager(fns), time_graph(fns)
            rows.append(dict(kernel="slot_scatter", shape=shape, provider=name,
                             check=status if name == "nanoserve" else "",
                             eager_us=round(eager, 2), graph_us=round(graph, 2),
                             **{"GB/s": round(nbytes / (graph * 1e-6) / 1e9)}))  # fmt: skip
        ceiling = next(r for r in rows if r["shape"] == shape and r["provider"].endswith("ceiling"))
        torch_row = next(r for r in rows if r["shape"] == shape and r["provider"] == "torch_index")
        for r in rows:
            if r["shape"] == shape:
                r["vs_copy"] = round(r["graph_us"] / ceiling["graph_us"], 2)
                r["vs_torch"] = round(r["graph_us"] / torch_row["graph_us"], 2)
        del sets, per_set
        torch.cuda.empty_cache()
    write_csv(rows, "scatter.csv")
    plot_rows(rows, x="shape", y="GB/s", name="scatter.png",
              title="slot scatter, bf16 (graph replay)", ceiling="device_copy_ceiling")  # fmt: skip
    print_table(
        rows, ["shape", "provider", "check", "eager_us", "graph_us", "GB/s", "vs_copy", "vs_torch"]
    )


if __name__ == "__main__":
    main()
