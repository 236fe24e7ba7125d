"""Decode attention over rows that share a prompt's blocks: the shared-prefix (cascade) launch
against the same launch reading every row whole.

The classes are the workloads prefix sharing makes: rows of one prompt sampled apart (an EOS
spread, best-of-N), group rollouts (G rows of each of several prompts), a system prompt under a
few turns. bf16 (or FP8 pools with per-KV-head scales, ``--kv-dtype fp8_e4m3``, or INT8 pools
with per-slot scales, ``--kv-dtype int8``), block 16, blocks scattered at random, NaN in every
unused slot (INT8: NaN scales). Providers:
nanoserve's decode as the adapter launches it without a plan, the same with the plan
(``plan_shared_prefix`` over the tables, built once on the host and timed apart),
FlashInfer's paged decode over every row (bf16 pools, when it imports), and two pure reads:
of the K/V the rows hold (each row whole) and of the unique K/V (each shared block once).
Timed with
``triton.testing.do_bench_cudagraph`` rotating over input sets; errors against the float32
reference. Usage:
    python3 benchmarks/bench_shared_prefix.py [--classes eos-64x512-d64,...]
        [--kv-dtype fp8_e4m3|int8]
Prints one table (µs, GB/s of the unique bytes, x the unique read) and writes
$OUT/bench_shared_prefix.csv (``bench_shared_prefix_<kv-dtype>.csv`` for quantized pools).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_shared_prefix")

from bench_decode import flashinfer_or_reason  # noqa: E402
from bench_decode_classes import flashinfer_fn  # noqa: E402
from harness import ceiling, num_input_sets, rel_err, show_table, time_graph, versions  # noqa: E402

from nanoserve.kernels import SharedPrefixPlan, paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.quant import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    INT8_DTYPE,
    INT8_K_GROUP,
    dequantize,
    dequantize_int8,
    quantize,
    quantize_int8,
)
from nanoserve.kernels.shared_prefix import plan_shared_prefix  # noqa: E402
from nanoserve.kernels.triton_decode import paged_decode_attention_triton  # noqa: E402

BS = 16
DTYPE = torch.bfloat16
MIB = 2**20


def drawn(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


# a group rollout: 16 prompts of 256..2048 tokens (whole blocks), 8 rows each, 1..256 own
GROUP_PROMPTS = [p // BS * BS for p in drawn(16, 256, 2048, 2)]
GROUP_OWN = drawn(128, 1, 256, 3)

# name: (prefix tokens of each group, rows a group, own tokens of each row, Hq, Hkv, head dim)
CLASSES = {
    # 64 sampled rows of one 512-token prompt, 65 tokens each so far (the EOS-spread call)
    "eos-64x512-own65-d64": ([512], 64, [65] * 64, 32, 8, 64),
    "eos-64x512-ragged-d64": ([512], 64, drawn(64, 1, 512, 1), 32, 8, 64),
    "group-16x8-d64": (GROUP_PROMPTS, 8, GROUP_OWN, 32, 8, 64),
    "group-16x8-d128": (GROUP_PROMPTS, 8, GROUP_OWN, 32, 8, 128),
    # best-of-8 over a 4k prompt (Qwen-7B's 28 / 4 heads)
    "best8-4096-gqa7": ([4096], 8, drawn(8, 1, 512, 4), 28, 4, 128),
    # a system prompt under four turns
    "sys-4x2048-d128": ([2048], 4, [64] * 4, 32, 8, 128),
    # 16 rows of one prompt, short so far
    "n16-1024-d128": ([1024], 16, [17] * 16, 32, 8, 128),
}


def make_set(prefixes, per_group, own, hq, hkv, dim, kv_dtype=None) -> dict:
    """Pools with each group's prefix in blocks of its own and each row's tokens after it in
    blocks of the row's, scattered; NaN in every slot no row holds."""
    rows = len(prefixes) * per_group
    own_pages = [-(-n // BS) for n in own]
    prefix_pages = [p // BS for p in prefixes]
    total = sum(prefix_pages) + sum(own_pages) + 8
    kc = torch.full((total, BS, hkv, dim), float("nan"), device="cuda", dtype=DTYPE)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(total, device="cuda").int()
    width = max(prefix_pages) + max(own_pages)
    bt = torch.zeros(rows, width, dtype=torch.int32, device="cuda")
    taken = 0

    def fill(pages: int, tokens: int) -> torch.Tensor:
        nonlocal taken
        blocks = perm[taken : taken + pages]
        taken += pages
        for pool in (kc, vc):
            flat = torch.randn(pages * BS, hkv, dim, device="cuda", dtype=DTYPE)
            flat[tokens:] = float("nan")
            pool[blocks.long()] = flat.view(pages, BS, hkv, dim)
        return blocks

    lens = []
    for g, prefix in enumerate(prefixes):
        shared = fill(prefix // BS, prefix)
        for r in range(g * per_group, (g + 1) * per_group):
            mine = fill(own_pages[r], own[r])
            bt[r, : shared.numel()] = shared
            bt[r, shared.numel() : shared.numel() + mine.numel()] = mine
            lens.append(prefix + own[r])
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, hq, dim, device="cuda", dtype=DTYPE)
    scales = {}
    if kv_dtype == "int8":  # per-slot scales (K's per 16 channels); NaN slots get NaN scales
        (kc, scales["kc"]), (vc, scales["vc"]) = quantize_int8(kc), quantize_int8(vc, None)
    if kv_dtype == "fp8_e4m3":  # per-KV-head scales fitting each head's finite amax
        for name, pool in (("kc", kc), ("vc", vc)):
            amax = pool.float().nan_to_num(0.0).abs().amax(dim=(0, 1, 3)).clamp_min(1e-3)
            scales[name] = amax / FP8_MAX
        kc, vc = quantize(kc, scales["kc"]), quantize(vc, scales["vc"])
    pages = [p + o for p, o in zip([pp for pp in prefix_pages for _ in range(per_group)],
                                   own_pages, strict=True)]  # fmt: skip
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, pages=pages, lens=lens, hq=hq, hkv=hkv, dim=dim,
                k_scale=scales.get("kc"), v_scale=scales.get("vc"))  # fmt: skip


def nanoserve_fn(s: dict, plan: SharedPrefixPlan | None):
    def run():
        return paged_decode_attention_triton(
            s["q"], s["kc"], s["vc"], s["bt"], s["sl"], scale=s["dim"] ** -0.5,
            sliding_window=None, softcap=None, shared_prefix=plan,
            k_scale=s["k_scale"], v_scale=s["v_scale"],
        )  # fmt: skip

    return run


def reference(s: dict) -> torch.Tensor:
    """float32 decode attention over the set's (dequantized) pools, on the host."""
    kc, vc = s["kc"], s["vc"]
    undo = {FP8_DTYPE: dequantize, INT8_DTYPE: dequantize_int8}.get(kc.dtype)
    if undo is not None:
        kc, vc = undo(kc, s["k_scale"], torch.float32), undo(vc, s["v_scale"], torch.float32)
    return paged_decode_attention_ref(
        s["q"].float(), kc.float(), vc.float(), s["bt"], s["sl"], check=False
    ).cpu()


def token_bytes(hkv: int, dim: int, kv_dtype: str | None) -> int:
    """K/V bytes a token holds (INT8: its float16 scales too)."""
    if kv_dtype == "int8":
        return hkv * (2 * dim + 2 * (-(-dim // INT8_K_GROUP) + 1))
    return hkv * dim * 2 * (1 if kv_dtype == "fp8_e4m3" else 2)


def measure(name: str, flashinfer, kv_dtype: str | None) -> list[dict]:
    prefixes, per_group, own, hq, hkv, dim = CLASSES[name]
    per_token = token_bytes(hkv, dim, kv_dtype)
    whole = (sum(prefixes) * per_group + sum(own)) * per_token
    unique = (sum(prefixes) + sum(own)) * per_token
    sets = [make_set(prefixes, per_group, own, hq, hkv, dim, kv_dtype)
            for _ in range(num_input_sets(whole))]  # fmt: skip
    s0 = sets[0]
    ref = reference(s0)
    tables, lens = s0["bt"].cpu().numpy(), s0["sl"].cpu().numpy()
    start = time.perf_counter()
    plan_shared_prefix(tables, lens, BS)
    plan_us = (time.perf_counter() - start) * 1e6
    providers = {"nanoserve_whole_rows": [nanoserve_fn(s, None) for s in sets]}
    plans = []
    for s in sets:
        plan = plan_shared_prefix(s["bt"].cpu().numpy(), s["sl"].cpu().numpy(), BS)
        plans.append(SharedPrefixPlan(plan.prefix_lens.cuda(), plan.tiles.cuda()))
    providers["nanoserve_shared_prefix"] = [
        nanoserve_fn(s, p) for s, p in zip(sets, plans, strict=True)
    ]
    if flashinfer is not None and kv_dtype is None:
        providers["flashinfer_whole_rows"] = [flashinfer_fn(s, flashinfer) for s in sets]
    rows = []
    for provider, fns in providers.items():
        err = rel_err(fns[0]().float().cpu(), ref)
        us = time_graph(fns).median
        gbps = round(unique / (us * 1e-6) / 1e9)
        rows.append(dict(cls=name, rows=len(own), provider=provider, us=round(us, 1),
                         GBps_unique=gbps, err=f"{err:.1e}"))  # fmt: skip
    for label, nbytes in (("read_whole_rows", whole), ("read_unique", unique)):
        read = ceiling(nbytes, len(sets), graph=True).median
        rows.append(dict(cls=name, rows=len(own), provider=label, us=round(read, 1),
                         GBps_unique=round(unique / (read * 1e-6) / 1e9)))  # fmt: skip
    unique_read = rows[-1]["us"]
    for r in rows:
        r["x_unique_read"] = round(r["us"] / unique_read, 2)
        r["plan_host_us"] = round(plan_us)
    del sets, providers, plans
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated names")
    parser.add_argument("--kv-dtype", default=None, choices=["fp8_e4m3", "int8"],
                        help="quantized pools instead of bf16")  # fmt: skip
    args = parser.parse_args()
    print(f"pools: {args.kv_dtype or 'bf16'}")
    torch.manual_seed(0)
    print(versions())
    flashinfer, reason = flashinfer_or_reason()
    print(f"flashinfer: {flashinfer.__version__ if flashinfer else reason}")
    rows = []
    for name in args.classes.split(","):
        measured = measure(name, flashinfer, args.kv_dtype)
        for r in measured:
            print(r, flush=True)
        rows += measured
    columns = ["cls", "rows", "provider", "us", "GBps_unique", "x_unique_read", "err",
               "plan_host_us"]  # fmt: skip
    suffix = f"_{args.kv_dtype}" if args.kv_dtype else ""
    show_table(rows, f"bench_shared_prefix{suffix}.csv", columns)


if __name__ == "__main__":
    main()
