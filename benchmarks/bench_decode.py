"""Paged decode attention on the GPU: nanoserve vs torch SDPA (contiguous K/V), a naive
gather-then-SDPA, FlashInfer's paged decode (tensor cores) and a pure read of the same bytes
(the ceiling for that size).

bf16, Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128) and Llama-3.2-1B (32/8/64),
block size 16, blocks scattered at random; batch 1/8/32/128 x context 512/2048/8192/32768
(shapes whose K/V exceeds 40 GB skipped); ``--quick``: every batch at a short and a long
context (QUICK_SHAPES), shorter timings. FlashInfer 0.5.3 is optional: when it does not import,
its rows say why. Usage:
    python3 benchmarks/bench_decode.py [--quick] [--sweep] [--shapes 32x4096,...] [--dims 128,64]
Timed with triton.testing (``do_bench_cudagraph``: median µs under CUDA-graph replay, the calls
rotating over enough input sets to miss the L2; eager ``do_bench`` too for shapes under 64 MiB).
Per head dim and batch, ``triton.testing.perf_report`` prints GB/s per provider against the
context and writes decode_d<dim>_b<batch>.csv/.png under $OUT (the band: 20th to 80th
percentile); then the table RESULTS.md uses is printed and written to $OUT/bench_decode.csv,
and plotted per head dim (GB/s against the shape) as $OUT/decode_d<dim>.png.
Each provider's error is against a float64 reference computed on the host from host copies
of the query and contiguous K/V of the first REF_SEQS sequences; "inputs changed" in the err
column means the query, pools or tables were overwritten after the reference was taken.
``--check-only`` times nothing: per shape, each provider against that reference, a float64
host reference and SDPA (e.g. ``--check-only --shapes 8x32768,32x8192``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_decode")

import triton.testing  # noqa: E402
from harness import (  # noqa: E402
    Reference,
    ceiling,
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

from nanoserve.kernels import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.triton_decode import paged_decode_attention_triton  # noqa: E402

HQ, HKV, BS = 32, 8, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048, 8192, 32768)
SHAPES = [(b, c) for b in BATCHES for c in CONTEXTS]
# --quick: each batch at a short and a long context (8x32768 guards the reference's check)
QUICK_SHAPES = [(1, 2048), (1, 32768), (8, 2048), (8, 32768), (32, 512), (32, 8192),
                (128, 512), (128, 8192)]  # fmt: skip
HEAD_DIMS = (128, 64)
MAX_KV_BYTES = 40e9
EAGER_BELOW = 64 * 2**20  # eager timings only where launch overhead matters
REF_SEQS = 4  # the float32 reference covers this many sequences of each batch
SWEEP_SHAPES = [(32, 8192), (1, 32768), (128, 512)]
MIB = 2**20
# small K/V rotates over up to this many input sets, so graph replays read from memory, not L2
MAX_SETS = 64
PROVIDERS = ["pure_read_ceiling", "nanoserve", "flashinfer", "sdpa_contiguous", "gather_sdpa"]
STYLES = [("black", "--"), ("C0", "-"), ("C1", "-"), ("C2", "-"), ("C3", "-")]
COLUMNS = ["shape", "kv_MiB", "provider", "eager_us", "graph_us", "GB/s", "x_ceil", "x_sdpa"]
COLUMNS += ["x_flashinfer", "err"]


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
        # every row holds ctx tokens: the adapter tells the kernel so (equal_lengths)
        return paged_decode_attention(
            s["q"], s["kc"], s["vc"], s["bt"], s["sl"], check=False, equal_lengths=True
        )

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


def reference_rows(s: dict) -> Reference:
    """The timing run's reference: ``host_reference`` with fingerprints of the set's inputs
    (see harness.Reference)."""
    inputs = {name: s[name] for name in ("q", "kc", "vc", "bt", "sl", "k_cont", "v_cont")}
    return Reference(host_reference(s), inputs)


def paged_reference(s: dict) -> torch.Tensor:
    """float32 reference of the first REF_SEQS sequences on the device, through the pools
    and block table (nanoserve's torch reference, gathering only their blocks)."""
    n = min(REF_SEQS, s["bt"].shape[0])
    bt = s["bt"][:n]
    used = bt.flatten().long()
    kc, vc = s["kc"][used].float(), s["vc"][used].float()
    local = torch.arange(used.numel(), device=bt.device, dtype=torch.int32).view_as(bt)
    return paged_decode_attention_ref(s["q"][:n].float(), kc, vc, local, s["sl"][:n], check=False)


def host_reference(s: dict) -> torch.Tensor:
    """float64 reference of the first REF_SEQS sequences computed on the host from host
    copies of their query and contiguous K/V: no GPU kernel, gather or pool involved."""
    n = min(REF_SEQS, s["bt"].shape[0])
    q = s["q"][:n].cpu().double().view(n, HKV, HQ // HKV, -1)  # query heads by KV head
    k = s["k_cont"][:n].cpu().double()  # [n, Hkv, ctx, D]
    v = s["v_cont"][:n].cpu().double()
    weights = torch.softmax(torch.einsum("nkgd,nkcd->nkgc", q, k) * s["dim"] ** -0.5, -1)
    return torch.einsum("nkgc,nkcd->nkgd", weights, v).reshape(n, HQ, -1)


def cross_check(s: dict, flashinfer) -> None:
    """--check-only: each provider against the timing run's reference (float64, host), the
    float32 paged reference on the device and SDPA; then whether the two references agree.
    Tells a wrong reference from overwritten inputs from a wrong provider."""
    batch, ctx, dim = s["bt"].shape[0], s["bt"].shape[1] * BS, s["dim"]
    host_ref = reference_rows(s)
    paged_ref = paged_reference(s).cpu()
    outs = {name: fn() for name, fn in providers(s, flashinfer).items()}
    n = paged_ref.shape[0]
    sdpa = outs["sdpa_contiguous"][:n].cpu()
    for name, out in outs.items():
        out = out[:n].cpu()
        print(f"d{dim} {batch}x{ctx} {name}: err {host_ref.err(out)} (host fp64 ref), "
              f"{rel_err(out, paged_ref):.1e} (paged fp32 ref), {rel_err(out, sdpa):.1e} (sdpa), "
              f"norm {out.double().norm():.3g}")  # fmt: skip
    print(f"d{dim} {batch}x{ctx} paged fp32 ref vs host fp64 ref: "
          f"{rel_err(paged_ref, host_ref.ref):.1e}, norms {paged_ref.norm():.3g} / "
          f"{host_ref.ref.norm():.3g}; inputs changed: {host_ref.changed() or 'none'}")  # fmt: skip


class Shapes:
    """What ``perf_report`` measures: one (shape, provider) point at a time. The input sets of
    the shape being measured are built once for all its providers; every point also appends
    its row of the RESULTS table to ``rows``."""

    def __init__(self, flashinfer, fi_reason):
        self.flashinfer, self.fi_reason = flashinfer, fi_reason
        self.rows: list[dict] = []
        self.key = None
        self.current: dict = {}

    def _load(self, batch: int, ctx: int, dim: int) -> dict:
        if self.key != (batch, ctx, dim):
            self.current = {}
            torch.cuda.empty_cache()
            nbytes = kv_bytes(batch, ctx, dim)
            sets = [make_set(batch, ctx, dim) for _ in range(num_input_sets(nbytes, MAX_SETS))]
            per_set = [providers(s, self.flashinfer) for s in sets]
            self.current = dict(sets=sets, per_set=per_set, ref=reference_rows(sets[0]))
            self.key = (batch, ctx, dim)
        return self.current

    def __call__(self, context: int, provider: str, dim: int, batch: int):
        """GB/s of ``provider`` at ``batch`` x ``context``: (median, at p80, at p20 time)."""
        ctx, shape = context, f"{batch}x{context}"
        nbytes = kv_bytes(batch, ctx, dim)
        data = self._load(batch, ctx, dim)
        row = dict(shape=f"d{dim} {shape}", provider=provider, err="", eager_us="")
        eager = nbytes < EAGER_BELOW
        if provider == "pure_read_ceiling":
            graph = ceiling(nbytes, len(data["sets"]), graph=True)
            if eager:
                row["eager_us"] = round(ceiling(nbytes, len(data["sets"]), graph=False).median, 1)
        elif provider not in data["per_set"][0]:
            row["err"] = f"not run ({self.fi_reason})"
            self.rows.append(row)
            return math.nan, math.nan, math.nan
        else:
            fns = [p[provider] for p in data["per_set"]]
            row["err"] = data["ref"].err(fns[0]())
            try:
                graph = time_graph(fns)
            except RuntimeError as e:  # a provider that cannot be captured
                print(f"{provider} d{dim} {shape}: no graph ({e})", file=sys.stderr)
                graph = None
            if eager:
                row["eager_us"] = round(time_eager(fns).median, 1)
        if graph is None:
            row["graph_us"] = math.nan
            self.rows.append(row)
            return math.nan, math.nan, math.nan
        row["graph_us"] = graph.median
        self.rows.append(row)
        return tuple(nbytes / (us * 1e-6) / 1e9 for us in (graph.median, graph.p80, graph.p20))


def ratio(us: float, base: float):
    """``us / base`` to two places; "" where either time is missing."""
    return "" if math.isnan(us) or math.isnan(base) else round(us / base, 2)


def finish_rows(rows: list[dict]) -> list[dict]:
    """The RESULTS columns derived per shape: K/V MiB, GB/s, and the ratios to the ceiling,
    SDPA and FlashInfer (timed rows only)."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        timed = {r["provider"]: r for r in rows if r["shape"] == shape and "graph_us" in r}
        head_dim, batch_ctx = shape.split()
        batch, ctx = (int(x) for x in batch_ctx.split("x"))
        nbytes = kv_bytes(batch, ctx, int(head_dim[1:]))
        bases = {"x_ceil": "pure_read_ceiling", "x_sdpa": "sdpa_contiguous"}
        if "flashinfer" in timed:
            bases["x_flashinfer"] = "flashinfer"
        for r in timed.values():
            us = r["graph_us"]
            r["kv_MiB"] = round(nbytes / MIB, 1)
            r["GB/s"] = "" if math.isnan(us) else round(nbytes / (us * 1e-6) / 1e9)
            for column, base in bases.items():
                r[column] = ratio(us, timed[base]["graph_us"])
        for r in timed.values():
            r["graph_us"] = "" if math.isnan(r["graph_us"]) else round(r["graph_us"], 1)
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
        err = ref.err(fns[0]())
        us = time_graph(fns).median
        rows.append(dict(shape=f"d{dim} {batch}x{ctx}", splits=splits or "auto",
                         config=config or "default", graph_us=round(us, 1),
                         GBps=round(nbytes / (us * 1e-6) / 1e9), err=err))  # fmt: skip
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
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timings")
    args = parser.parse_args()
    set_quick(args.quick)
    shapes = QUICK_SHAPES if quick() else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dims = [int(d) for d in args.dims.split(",")]
    torch.manual_seed(0)
    print(versions())
    if args.sweep:
        sweep_shapes = shapes if args.shapes else SWEEP_SHAPES
        sweep = [r for d in dims for b, c in sweep_shapes for r in sweep_shape(b, c, d)]
        show_table(sweep, "decode_sweep.csv")
        return
    flashinfer, fi_reason = flashinfer_or_reason()
    print(f"flashinfer: {flashinfer.__version__ if flashinfer else fi_reason}")
    if args.check_only:
        for dim in dims:
            for b, c in shapes:
                cross_check(make_set(b, c, dim), flashinfer)
        return
    measure = Shapes(flashinfer, fi_reason)
    for dim in dims:
        for batch in dict.fromkeys(b for b, _ in shapes):
            contexts = []
            for c in (c for b, c in shapes if b == batch):
                if kv_bytes(batch, c, dim) > MAX_KV_BYTES:
                    print(f"skip d{dim} {batch}x{c}: K/V over {MAX_KV_BYTES / 1e9:.0f} GB")
                else:
                    contexts.append(c)
            if not contexts:
                continue
            report = triton.testing.Benchmark(
                x_names=["context"],
                x_vals=contexts,
                x_log=True,
                line_arg="provider",
                line_vals=PROVIDERS,
                line_names=PROVIDERS,
                styles=STYLES,
                ylabel="GB/s",
                xlabel=f"context (batch {batch}, head_dim {dim}, bf16, graph replay)",
                plot_name=f"decode_d{dim}_b{batch}",
                args={"dim": dim, "batch": batch},
            )
            triton.testing.perf_report(report)(measure).run(print_data=True, save_path=out_dir())
    rows = finish_rows(measure.rows)
    show_table(rows, "bench_decode.csv", COLUMNS)
    for dim in dims:
        timed = [r for r in rows if r["shape"].startswith(f"d{dim} ") and r.get("GB/s", "") != ""]
        plot_rows(timed, x="shape", y="GB/s", name=f"decode_d{dim}.png",
                  title=f"paged decode, head_dim {dim}, bf16, graph replay",
                  ceiling="pure_read_ceiling")  # fmt: skip


if __name__ == "__main__":
    main()
