"""Decode split counts where few (row, KV head) pairs share long tables: the launcher's plan
against fixed 32 / 64 / 128 / 256 splits and the balanced launch, per table length, heads and
head dim (the sweep behind ``choose_num_splits``'s MAX_SPLITS_LONG; benchmarks/RESULTS.md,
2026-12-04, twenty-ninth session, runs 4-5 and 10-11, which ran it as an uncommitted script).

bf16 pools (or FP8 with ``--fp8``), block size 16, blocks scattered at random, µs under
CUDA-graph replay with input sets rotated past the L2, beside a pure read of the same bytes.
Each cell's error against a float64 reference on the host is checked before any timing; a
cell over 1e-2 is printed with its error.

    python3 benchmarks/bench_decode_splits.py [--lengths 16384,32768,65536]
        [--heads 28/4,12/2,16/1,32/8] [--head-dims 128] [--batches 1,2] [--fp8]
        [--merge-elements whole,8192,4096,2048,1024]

``--merge-elements`` times the launcher's plan instead, with the split merge's
``REDUCE_TILE_ELEMENTS`` set to each value in turn ("whole": every head-dim lane in one
program), two interleaved rounds, the faster of the two.

Prints one table; with $OUT set, writes decode_splits.csv (or decode_merge.csv) there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_decode_splits")

import torch  # noqa: E402
from harness import ceiling, num_input_sets, rel_err, show_table, time_graph, versions  # noqa: E402

from nanoserve.kernels import paged_decode_attention_ref, triton_decode  # noqa: E402
from nanoserve.kernels.quant import FP8_MAX, quantize  # noqa: E402

BS = 16
FIXED_SPLITS = (32, 64, 128, 256)


def make_set(batch: int, length: int, hq: int, hkv: int, dim: int, fp8: bool) -> dict:
    used = batch * length // BS
    total = used + 64
    kc = torch.randn(total, BS, hkv, dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(total, BS, hkv, dim, device="cuda", dtype=torch.bfloat16)
    scale = None
    if fp8:
        scale = torch.full((hkv,), 4.0 / FP8_MAX, device="cuda")
        kc = quantize(kc.view(-1, hkv, dim), scale).view(kc.shape)
        vc = quantize(vc.view(-1, hkv, dim), scale).view(vc.shape)
    bt = torch.randperm(total, device="cuda")[:used].view(batch, -1).int().contiguous()
    sl = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16)
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, scale=scale)


def host_reference(s: dict) -> torch.Tensor:
    """float64 on the host (FP8 pools: the reference dequantizes them, query in float32)."""
    fp8 = s["scale"] is not None
    scale = s["scale"].cpu() if fp8 else None
    return paged_decode_attention_ref(
        s["q"].float().cpu() if fp8 else s["q"].double().cpu(),
        s["kc"].cpu() if fp8 else s["kc"].double().cpu(),
        s["vc"].cpu() if fp8 else s["vc"].double().cpu(),
        s["bt"].cpu(), s["sl"].cpu(), k_scale=scale, v_scale=scale,
    )  # fmt: skip


def launch(s: dict, num_splits=None, work_items=None):
    dim = s["q"].shape[-1]
    return lambda: triton_decode.paged_decode_attention_triton(
        s["q"], s["kc"], s["vc"], s["bt"], s["sl"], scale=dim**-0.5, sliding_window=None,
        softcap=None, num_splits=num_splits, work_items=work_items,
        k_scale=s["scale"], v_scale=s["scale"],
    )  # fmt: skip


def prepare(batch: int, length: int, hq: int, hkv: int, dim: int, fp8: bool):
    """(input sets rotated past the L2, float64 host reference of the first, the row's shape
    and plan columns, and a ``read()`` that fills its pure-read column: called after the
    errors, so that no timing runs before them)."""
    nbytes = batch * length * hkv * dim * (2 if fp8 else 4)
    sets = [make_set(batch, length, hq, hkv, dim, fp8) for _ in range(num_input_sets(nbytes))]
    ref = host_reference(sets[0])
    plan = triton_decode.decode_plan(sets[0]["q"], sets[0]["kc"], sets[0]["bt"])
    shape = f"{batch} x {length}, {hq}/{hkv}, d{dim}{', fp8' if fp8 else ''}"
    chosen = f"{plan.num_splits} splits" if plan.num_splits else f"balanced ({plan.work_items})"
    row = dict(shape=shape, plan=chosen, read=None)

    def read() -> None:
        row["read"] = round(ceiling(nbytes, len(sets), graph=True).median, 1)

    return sets, ref, row, read


def cell(us: float, error: float) -> str:
    """A timing, with its error where that is over 1e-2."""
    return f"{us:.1f}" + ("" if error < 1e-2 else f" (error {error:.1e})")


def measure(batch: int, length: int, hq: int, hkv: int, dim: int, fp8: bool) -> dict:
    sets, ref, row, read = prepare(batch, length, hq, hkv, dim, fp8)
    forms = {"launcher": {}}
    forms.update({str(n): dict(num_splits=n) for n in FIXED_SPLITS})
    if batch > 1:
        items = triton_decode.choose_work_items(batch, hkv, sets[0]["q"].device)
        forms["balanced"] = dict(work_items=items)
    errors = {name: rel_err(launch(sets[0], **kw)().cpu(), ref) for name, kw in forms.items()}
    read()
    for name, kw in forms.items():
        row[name] = cell(time_graph([launch(s, **kw) for s in sets]).median, errors[name])
    del sets
    torch.cuda.empty_cache()
    return row


def merge_elements(value: str) -> int:
    return 1 << 40 if value == "whole" else int(value)


def measure_merge(batch, length, hq, hkv, dim, fp8, values: list[str]) -> dict:
    """The launcher's plan with REDUCE_TILE_ELEMENTS at each of ``values``: µs (and errors)."""
    sets, ref, row, read = prepare(batch, length, hq, hkv, dim, fp8)
    read()
    kept = triton_decode.REDUCE_TILE_ELEMENTS
    times: dict[str, list[float]] = {v: [] for v in values}
    errors = {}
    try:
        for _ in range(2):
            for v in values:
                triton_decode.REDUCE_TILE_ELEMENTS = merge_elements(v)
                errors.setdefault(v, rel_err(launch(sets[0])().cpu(), ref))
                times[v].append(time_graph([launch(s) for s in sets]).median)
    finally:
        triton_decode.REDUCE_TILE_ELEMENTS = kept
    for v in values:
        row[f"merge {v}"] = cell(min(times[v]), errors[v])
    del sets
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16384,32768,65536")
    parser.add_argument("--heads", default="28/4,12/2,16/1,32/8", help="query/KV heads")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--fp8", action="store_true", help="FP8 pools")
    parser.add_argument("--merge-elements", help="e.g. whole,8192,4096,2048,1024")
    args = parser.parse_args()
    values = args.merge_elements.split(",") if args.merge_elements else None
    for v in values or []:
        if v != "whole" and not v.isdigit():
            parser.error(f"--merge-elements: {v!r} is neither 'whole' nor a count")
    print(versions())
    rows = []
    for dim in (int(d) for d in args.head_dims.split(",")):
        for heads in args.heads.split(","):
            hq, hkv = (int(h) for h in heads.split("/"))
            for batch in (int(b) for b in args.batches.split(",")):
                for length in (int(n) for n in args.lengths.split(",")):
                    shape = (batch, length, hq, hkv, dim, args.fp8)
                    rows.append(measure_merge(*shape, values) if values else measure(*shape))
                    print(rows[-1], flush=True)
    show_table(rows, "decode_merge.csv" if values else "decode_splits.csv")


if __name__ == "__main__":
    main()
