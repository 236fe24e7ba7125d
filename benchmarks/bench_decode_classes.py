"""Paged decode attention on the shape classes users run beside the uniform grid: ragged
batches, batch 1 at long context with 4 or 8 KV heads, mid-sized K/V, large uniform batches.

bf16, block 16, blocks scattered at random, NaN in every unused slot of the pools (a leak shows
as a non-finite error). Per class: nanoserve's default launch (balanced work items), its
balanced launch at other targets (``--sweep``), the fixed-split launch it used before, FlashInfer
0.5.3's paged decode with tensor cores over the same pools (when it imports), and a pure read of
the K/V bytes the rows hold. Timed with ``triton.testing.do_bench_cudagraph`` rotating over
input sets; errors against the float32 reference over every row. Usage:
    python3 benchmarks/bench_decode_classes.py [--classes ragged64,b1-32k-gqa7] [--sweep]
Prints one table (µs, GB/s, x FlashInfer, x read) and writes $OUT/bench_decode_classes.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_decode_classes")

import triton  # noqa: E402
from bench_decode import flashinfer_or_reason  # noqa: E402
from harness import ceiling, num_input_sets, rel_err, show_table, time_graph, versions  # noqa: E402

from nanoserve.kernels import paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.dispatch import sm_count  # noqa: E402
from nanoserve.kernels.triton_decode import (  # noqa: E402
    choose_num_splits,
    decode_plan,
    paged_decode_attention_triton,
)

BS = 16
DTYPE = torch.bfloat16
MIB = 2**20


def lengths(kind: str, batch: int, lo: int, hi: int) -> list[int]:
    """Row lengths: "uniform" all ``hi``; "ragged" drawn uniformly in [lo, hi] (seeded)."""
    if kind == "uniform":
        return [hi] * batch
    g = torch.Generator().manual_seed(batch * 7919 + hi)
    return torch.randint(lo, hi + 1, (batch,), generator=g).tolist()


# name: (row lengths, query heads, KV heads, head dim)
CLASSES = {
    "ragged64": (lengths("ragged", 64, 100, 8000), 32, 8, 128),
    "ragged64-gqa7": (lengths("ragged", 64, 100, 8000), 28, 4, 128),
    "ragged256-d64": (lengths("ragged", 256, 10, 2000), 32, 8, 64),
    "ragged16-long": (lengths("ragged", 16, 1000, 32000), 32, 8, 128),
    # one long row among short ones: most of the items are one row's
    "ragged32-one-long": ([32000] + [300] * 31, 32, 8, 128),
    "b1-32k-gqa7": ([32768], 28, 4, 128),
    "b1-32k-gqa4": ([32768], 32, 8, 128),
    "b1-128k-gqa4": ([131072], 32, 8, 128),
    "b1-64k-gqa7": ([65536], 28, 4, 128),
    # two KV heads (Qwen2.5-1.5B's 12 / 2 heads)
    "b1-32k-2kv": ([32768], 12, 2, 128),
    "b1-16k-gqa7": ([16384], 28, 4, 128),
    "b1-8k-2kv": ([8192], 12, 2, 128),
    "mid-8x4096": (lengths("uniform", 8, 0, 4096), 32, 8, 128),
    "mid-16x4096": (lengths("uniform", 16, 0, 4096), 32, 8, 128),
    "mid-4x8192-gqa7": (lengths("uniform", 4, 0, 8192), 28, 4, 128),
    # equal rows where the balanced launch lost to the fixed splits (RESULTS.md, 2026-12-04)
    "mid-16x8192-gqa7": (lengths("uniform", 16, 0, 8192), 28, 4, 128),
    "b2-32k-2kv": (lengths("uniform", 2, 0, 32768), 12, 2, 128),
    "uniform-32x8192": (lengths("uniform", 32, 0, 8192), 32, 8, 128),
    "uniform-128x2048": (lengths("uniform", 128, 0, 2048), 32, 8, 128),
    "uniform-128x512": (lengths("uniform", 128, 0, 512), 32, 8, 128),
    "uniform-8x2048-d64": (lengths("uniform", 8, 0, 2048), 32, 8, 64),
    # a 1B-shaped model's decode batches (32 / 8 heads, head dim 64) at ~1k tokens a row
    "loop-16x1032-d64": (lengths("uniform", 16, 0, 1032), 32, 8, 64),
    "loop-32x1032-d64": (lengths("uniform", 32, 0, 1032), 32, 8, 64),
    "loop-64x1032-d64": (lengths("uniform", 64, 0, 1032), 32, 8, 64),
    "loop-ragged32-d64": (lengths("ragged", 32, 128, 2304), 32, 8, 64),
}
SWEEP_ITEMS_PER_SM = (2, 4, 8, 16)


def kv_bytes(lens: list[int], hkv: int, dim: int) -> int:
    return sum(lens) * hkv * dim * 2 * 2


def make_set(lens: list[int], hq: int, hkv: int, dim: int) -> dict:
    """Pools holding the rows' K/V in scattered blocks, NaN in every slot no row holds."""
    pages = [-(-n // BS) for n in lens]
    total = sum(pages) + 8
    kc = torch.full((total, BS, hkv, dim), float("nan"), device="cuda", dtype=DTYPE)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(total, device="cuda").int()
    width = max(pages)
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    start = 0
    for i, (n, p) in enumerate(zip(lens, pages, strict=True)):
        blocks = perm[start : start + p]
        start += p
        bt[i, :p] = blocks
        flat_k = torch.randn(p * BS, hkv, dim, device="cuda", dtype=DTYPE)
        flat_v = torch.randn(p * BS, hkv, dim, device="cuda", dtype=DTYPE)
        flat_k[n:] = float("nan")
        flat_v[n:] = float("nan")
        kc[blocks.long()] = flat_k.view(p, BS, hkv, dim)
        vc[blocks.long()] = flat_v.view(p, BS, hkv, dim)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), hq, dim, device="cuda", dtype=DTYPE)
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, pages=pages, lens=lens, hq=hq, hkv=hkv, dim=dim)


def flashinfer_fn(s: dict, flashinfer):
    """FlashInfer's paged decode (tensor cores) over the same pools and ragged rows."""
    workspace = torch.zeros(128 * MIB, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    pages = torch.tensor(s["pages"], dtype=torch.int32, device="cuda")
    indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0).int()])
    indices = torch.cat([s["bt"][i, :p] for i, p in enumerate(s["pages"])]).contiguous()
    last = torch.tensor([n - (p - 1) * BS for n, p in zip(s["lens"], s["pages"], strict=True)],
                        dtype=torch.int32, device="cuda")  # fmt: skip
    wrapper.plan(
        indptr, indices, last, s["hq"], s["hkv"], s["dim"], BS,
        q_data_type=DTYPE, kv_data_type=DTYPE,
    )  # fmt: skip
    s["_fi"] = (workspace, wrapper)
    return lambda: wrapper.run(s["q"], (s["kc"], s["vc"]))


def nanoserve_fn(s: dict, **launch):
    def run():
        return paged_decode_attention_triton(
            s["q"], s["kc"], s["vc"], s["bt"], s["sl"], scale=s["dim"] ** -0.5,
            sliding_window=None, softcap=None, **launch,
        )  # fmt: skip

    return run


def reference(s: dict) -> torch.Tensor:
    return paged_decode_attention_ref(
        s["q"].float(), s["kc"].float(), s["vc"].float(), s["bt"], s["sl"], check=False
    )


def candidates(s: dict, flashinfer, sweep: bool) -> dict:
    """provider name -> callable, for one input set."""
    batch, hkv = len(s["lens"]), s["hkv"]
    capacity = s["bt"].shape[1] * BS
    plan = decode_plan(s["q"], s["kc"], s["bt"])
    old_splits = choose_num_splits(batch, hkv, capacity, plan.block_n, s["q"].device)
    # the adapter tells the kernel whether the rows are of one length (equal_lengths)
    equal = min(s["lens"]) == max(s["lens"])
    out = {
        "nanoserve": nanoserve_fn(s, equal_lengths=equal),
        f"fixed_splits_{old_splits}": nanoserve_fn(s, num_splits=old_splits),
    }
    if equal:  # what the launcher takes for these shapes without the hint
        out["nanoserve_not_told_equal"] = nanoserve_fn(s)
    if sweep:
        for splits in (1, 2, 4):
            out.setdefault(f"fixed_splits_{splits}", nanoserve_fn(s, num_splits=splits))
        for per_sm in SWEEP_ITEMS_PER_SM:
            items = triton.cdiv(per_sm * sm_count(s["q"].device), hkv)
            out[f"balanced_{per_sm}_per_sm"] = nanoserve_fn(s, work_items=items)
            for config in ((128, 4, 2), (64, 4, 3)):
                name = f"balanced_{per_sm}_per_sm_{'_'.join(map(str, config))}"
                out[name] = nanoserve_fn(s, work_items=items, config=config)
    if flashinfer is not None:
        out["flashinfer"] = flashinfer_fn(s, flashinfer)
    return out


def measure(name: str, flashinfer, sweep: bool) -> list[dict]:
    lens, hq, hkv, dim = CLASSES[name]
    nbytes = kv_bytes(lens, hkv, dim)
    sets = [make_set(lens, hq, hkv, dim) for _ in range(num_input_sets(nbytes))]
    # on the host: once, a reference kept on the GPU across the timed graphs read back
    # changed (benchmarks/RESULTS.md, twenty-ninth session)
    ref = reference(sets[0]).cpu()
    per_set = [candidates(s, flashinfer, sweep) for s in sets]
    read = ceiling(nbytes, len(sets), graph=True).median
    rows = []
    for provider in per_set[0]:
        fns = [p[provider] for p in per_set]
        err = rel_err(fns[0]().cpu(), ref)
        us = time_graph(fns).median
        rows.append(dict(cls=name, kv_MiB=round(nbytes / MIB), provider=provider,
                         us=round(us, 1), GBps=round(nbytes / (us * 1e-6) / 1e9),
                         x_read=round(us / read, 2), err=f"{err:.1e}"))  # fmt: skip
    fi = next((r["us"] for r in rows if r["provider"] == "flashinfer"), None)
    for r in rows:
        r["x_flashinfer"] = round(r["us"] / fi, 2) if fi else ""
    gbps = round(nbytes / (read * 1e-6) / 1e9)
    rows.append(dict(cls=name, kv_MiB=round(nbytes / MIB), provider="pure_read",
                     us=round(read, 1), GBps=gbps, x_read=1.0))  # fmt: skip
    del sets, per_set
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated names")
    parser.add_argument("--sweep", action="store_true", help="also other balanced targets")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(versions())
    flashinfer, reason = flashinfer_or_reason()
    print(f"flashinfer: {flashinfer.__version__ if flashinfer else reason}")
    rows = []
    for name in args.classes.split(","):
        rows += measure(name, flashinfer, args.sweep)
        for r in rows[-3:]:
            print(r, flush=True)
    columns = ["cls", "kv_MiB", "provider", "us", "GBps", "x_read", "x_flashinfer", "err"]
    show_table(rows, "bench_decode_classes.csv", columns)


if __name__ == "__main__":
    main()
