"""Paged decode attention on the GPU: nanoserve vs torch SDPA (contiguous K/V), a naive
gather-then-SDPA, FlashInfer's paged decode (tensor cores) and a pure read of the same bytes
(the ceiling for that size).

bf16, Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128) and Llama-3.2-1B (32/8/64),
block size 16, blocks scattered at random; batch 1/8/32/128 x context 512/2048/8192/32768
(shapes whose K/V exceeds 40 GB skipped). FlashInfer 0.5.3 is optional: when it does not import,
its rows say why. Usage:
    python3 benchmarks/bench_decode.py [--sweep] [--shapes 32x4096,...] [--dims 128,64]
Prints a markdown table (median µs under CUDA-graph replay, eager too for shapes under 64 MiB);
writes CSV and a plot (GB/s per shape, one line per provider, the ceiling dashed) under $OUT.
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
from plot import plot_rows  # noqa: E402

from nanoserve.kernels import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.triton_decode import paged_decode_attention_triton  # noqa: E402

HQ, HKV, BS = 32, 8, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048, 8192, 32768)
SHAPES = [(b, c) for b in BATCHES for c in CONTEXTS]
HEAD_DIMS = (128, 64)
MAX_KV_BYTES = 40e9
EAGER_BELOW = 64 * 2**20  # eager timings only where launch overhead matters
REF_SEQS = 4  # the float32 reference covers this many sequences of each batch
SWEEP_SHAPES = [(32, 8192), (1, 32768), (128, 512)]
MIB = 2**20


def kv_bytes(batch: int, ctx: int, dim: int) -> int:
    return batch * ctx * HKV * dim * 2 * 2


def make_set(batch: int, ctx: int, dim: int) -> dict:
    """One input set: paged pools with scattered blocks plus the same K/V laid out contiguously."""
    used = batch * ctx // BS
    total = used + 64
    kc = torch.randn(total, BS, HKV, dim, device="cuda", dtype=DTYPE)
    vc = torch.randn(total, BS, HKV, dim, device="cuda", dtype=DTYPE)
    bt = torch.randperm(total, device="cuda")[:used].view(batch, ctx // BS).int().contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, dim, device="cuda", dtype=DTYPE)
    k_cont = kc[bt.long()].view(batch, ctx, HKV, dim).transpose(1, 2).contiguous()
    v_cont = vc[bt.long()].view(batch, ctx, HKV, dim).transpose(1, 2).contiguous()
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, k_cont=k_cont, v_cont=v_cont, dim=dim)


def flashinfer_or_reason():
    """The flashinfer module, or a one-line reason it is not there."""
    try:
        import flashinfer

        return flashinfer, None
    except Exception as e:  # ImportError, or a broken install raising anything else
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:80]


def flashinfer_provider(s: dict, flashinfer):
    """FlashInfer's paged decode with tensor cores over the same pools (NHD = our layout)."""
    batch, pages = s["bt"].shape
    dim = s["dim"]
    workspace = torch.zeros(128 * MIB, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
    indices = s["bt"].flatten().contiguous()
    last_page_len = torch.full((batch,), BS, dtype=torch.int32, device="cuda")
    wrapper.plan(
        indptr, indices, last_page_len, HQ, HKV, dim, BS,
        q_data_type=DTYPE, kv_data_type=DTYPE,
    )  # fmt: skip
    s["_fi"] = (workspace, wrapper)  # keep alive with the set
    return lambda: wrapper.run(s["q"], (s["kc"], s["vc"]))


def providers(s: dict, flashinfer) -> dict:
    batch, ctx, dim = s["bt"].shape[0], s["bt"].shape[1] * BS, s["dim"]
    q4 = s["q"].view(batch, HQ, 1, dim)

    def nanoserve():
        return paged_decode_attention(s["q"], s["kc"], s["vc"], s["bt"], s["sl"], check=False)

    def sdpa():
        out = F.scaled_dot_product_attention(q4, s["k_cont"], s["v_cont"], enable_gqa=True)
        return out.view(batch, HQ, dim)

    def gather_sdpa():
        idx = s["bt"].long()
        k = s["kc"][idx].view(batch, ctx, HKV, dim).transpose(1, 2)
        v = s["vc"][idx].view(batch, ctx, HKV, dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).view(batch, HQ, dim)

    out = {"nanoserve": nanoserve, "sdpa_contiguous": sdpa, "gather_sdpa": gather_sdpa}
    if flashinfer is not None:
        out["flashinfer"] = flashinfer_provider(s, flashinfer)
    return out


def reference_rows(s: dict) -> torch.Tensor:
    """float32 reference of the first REF_SEQS sequences, gathering only their blocks."""
    n = min(REF_SEQS, s["bt"].shape[0])
    bt = s["bt"][:n]
    used = bt.flatten().long()
    kc, vc = s["kc"][used].float(), s["vc"][used].float()
    local = torch.arange(used.numel(), device="cuda", dtype=torch.int32).view_as(bt)
    return paged_decode_attention_ref(s["q"][:n].float(), kc, vc, local, s["sl"][:n], check=False)


def bench_shape(batch: int, ctx: int, dim: int, flashinfer, fi_reason) -> list[dict]:
    nbytes = kv_bytes(batch, ctx, dim)
    shape = f"d{dim} {batch}x{ctx}"
    sets = [make_set(batch, ctx, dim) for _ in range(num_input_sets(nbytes))]
    ref = reference_rows(sets[0])
    n_ref = ref.shape[0]
    eager = nbytes < EAGER_BELOW
    ceil_graph = ceiling_us(nbytes, len(sets), graph=True)
    rows = [dict(shape=shape, provider="pure_read_ceiling", err="",
                 eager_us=ceiling_us(nbytes, len(sets), graph=False) if eager else "",
                 graph_us=ceil_graph)]  # fmt: skip
    per_set = [providers(s, flashinfer) for s in sets]
    for name in per_set[0]:
        fns = [p[name] for p in per_set]
        err = rel_err(fns[0]()[:n_ref], ref)
        try:
            graph = time_graph(fns)
        except RuntimeError as e:  # a provider that cannot be captured
            print(f"{name} {shape}: no graph ({e})", file=sys.stderr)
            graph = float("nan")
        rows.append(dict(shape=shape, provider=name, err=f"{err:.1e}",
                         eager_us=time_eager(fns) if eager else "", graph_us=graph))  # fmt: skip
    if flashinfer is None:
        rows.append(dict(shape=shape, provider="flashinfer", err=f"not run ({fi_reason})"))
    for r in rows:
        if "graph_us" not in r:
            continue
        r["kv_MiB"] = round(nbytes / MIB, 1)
        r["GB/s"] = round(nbytes / (r["graph_us"] * 1e-6) / 1e9)
        r["x_ceil"] = round(r["graph_us"] / ceil_graph, 2)
        if r["eager_us"] != "":
            r["eager_us"] = round(r["eager_us"], 1)
        r["graph_us"] = round(r["graph_us"], 1)
    by = {r["provider"]: r for r in rows if "graph_us" in r}
    for r in by.values():
        r["x_sdpa"] = round(r["graph_us"] / by["sdpa_contiguous"]["graph_us"], 2)
        if "flashinfer" in by:
            r["x_flashinfer"] = round(r["graph_us"] / by["flashinfer"]["graph_us"], 2)
    del sets, per_set
    torch.cuda.empty_cache()
    return rows


def sweep_shape(batch: int, ctx: int, dim: int) -> list[dict]:
    """nanoserve alone over split counts and (BLOCK_N, warps, stages): tuning data."""
    nbytes = kv_bytes(batch, ctx, dim)
    sets = [make_set(batch, ctx, dim) for _ in range(num_input_sets(nbytes))]
    ref = reference_rows(sets[0])
    rows = []
    configs = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (256, 8, 2))
    variants = [(splits, c) for splits in (None, 2, 4) for c in configs]

    def variant(s: dict, splits, config):
        def run():
            return paged_decode_attention_triton(
                s["q"], s["kc"], s["vc"], s["bt"], s["sl"], scale=dim**-0.5,
                sliding_window=None, softcap=None, num_splits=splits, config=config,
            )  # fmt: skip

        return run

    for splits, config in variants:
        fns = [variant(s, splits, config) for s in sets]
        err = rel_err(fns[0]()[: ref.shape[0]], ref)
        us = time_graph(fns)
        rows.append(dict(shape=f"d{dim} {batch}x{ctx}", splits=splits or "auto",
                         config=config or "default", graph_us=round(us, 1),
                         GBps=round(nbytes / (us * 1e-6) / 1e9), err=f"{err:.1e}"))  # fmt: skip
        print(rows[-1], flush=True)
    del sets
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="sweep configs only")
    parser.add_argument("--shapes", default=None, help="e.g. 32x4096,1x32768")
    parser.add_argument("--dims", default=",".join(map(str, HEAD_DIMS)), help="head dims")
    parser.add_argument("--check-only", action="store_true", help="errors only, no timing")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dims = [int(d) for d in args.dims.split(",")]
    torch.manual_seed(0)
    print(versions())
    if args.sweep:
        sweep_shapes = shapes if args.shapes else SWEEP_SHAPES
        sweep = [r for d in dims for b, c in sweep_shapes for r in sweep_shape(b, c, d)]
        write_csv(sweep, "decode_sweep.csv")
        print_table(sweep, list(sweep[0]))
        return
    flashinfer, fi_reason = flashinfer_or_reason()
    print(f"flashinfer: {flashinfer.__version__ if flashinfer else fi_reason}")
    if args.check_only:
        for dim in dims:
            for b, c in shapes:
                s = make_set(b, c, dim)
                ref = reference_rows(s)
                for name, fn in providers(s, flashinfer).items():
                    print(f"d{dim} {b}x{c} {name}: err {rel_err(fn()[: ref.shape[0]], ref):.1e}")
        return
    rows = []
    for dim in dims:
        for b, c in shapes:
            if kv_bytes(b, c, dim) > MAX_KV_BYTES:
                print(f"skip d{dim} {b}x{c}: K/V over {MAX_KV_BYTES / 1e9:.0f} GB")
                continue
            rows += bench_shape(b, c, dim, flashinfer, fi_reason)
    write_csv(rows, "bench_decode.csv")
    for dim in dims:
        title = f"paged decode, bf16, 32/8 heads, head_dim {dim} (graph replay)"
        plot_rows([r for r in rows if r["shape"].startswith(f"d{dim} ") and "GB/s" in r],
                  x="shape", y="GB/s", name=f"decode_d{dim}.png", ceiling="pure_read_ceiling",
                  title=title)  # fmt: skip
    cols = ["shape", "kv_MiB", "provider", "eager_us", "graph_us", "GB/s", "x_ceil", "x_sdpa"]
    cols += ["x_flashinfer", "err"]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
