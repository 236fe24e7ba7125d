"""Paged extend attention per shape class: every candidate kernel config of nanoserve next to
FlashInfer's paged prefill and a pure read of the same K/V bytes. It decides nothing: the
table shows each candidate so the defaults can be picked from it: ``ROUTES`` (a fixed kernel
and config per route key; each class's key is printed in its pure_read row),
``CUDA_CONFIGS`` (what autotune tries), ``PACKED_MAX_QUERY_LEN``, ``FAST_TANH``,
``TILE_MAJOR_FAMILIES`` ("other-order" rows), ``TABLE_AHEAD`` ("table-ahead" rows) and
``WARP_SPECIALIZE`` in
triton_extend.py; ``packed_config`` and ``packed_splits`` in triton_verify.py,
``PARTIALS_16BIT`` in triton_split_merge.py. "auto" is
what the launcher does today (given max_query_len, as an adapter that knows it would pass).

bf16, block size 16, blocks scattered at random, NaN in every unused block (a read past a
sequence's end shows as err = inf). Each class (``CLASSES``) builds its pools once; every
nanoserve candidate (``candidates``) is checked against the float32 reference (relative
error) and timed with ``triton.testing.do_bench_cudagraph`` rotating over input sets;
FlashInfer 0.5.3's BatchPrefillWithPagedKVCacheWrapper (NHD, the same pools, causal, window
and soft-cap as the class) is optional: when it does not import, its rows say why.
Usage:
    python3 benchmarks/bench_extend_classes.py [--quick] [--check-only] [--classes verify,...]
        [--extra 'window=tiles:128,64,8,3;verify=packed:64,64,4,3:6'] [--kinds auto,tiles]
Prints one table (class, candidate, µs, x FlashInfer, x read, err) and writes it to
$OUT/extend_classes.csv when OUT is set. About 50 Triton compiles and 5 FlashInfer modules:
split the classes over two runs (``--classes``) if one run must stay short.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_extend_classes")

from bench_decode import flashinfer_or_reason  # noqa: E402
from harness import ceiling, num_input_sets, rel_err, rotating, show_table, versions  # noqa: E402

from nanoserve.kernels import (  # noqa: E402
    paged_extend_attention,
    paged_extend_attention_ref,
    triton_extend,
    triton_split_merge,
)
from nanoserve.kernels.triton_verify import paged_extend_attention_packed  # noqa: E402

BS = 16
DTYPE = torch.bfloat16
MIB = 2**20
MAX_SETS = 4
COLUMNS = ["class", "candidate", "us", "x_flashinfer", "x_read", "err", "note"]
EXTRA: dict[str, list[tuple]] = {}  # --extra candidates per class
KINDS: set[str] = set()  # --kinds: the candidate kinds timed (all when empty)
TILE_MAJOR = triton_extend.TILE_MAJOR_FAMILIES


@dataclass(frozen=True)
class ExtendClass:
    """One shape class: heads, head dim, per-sequence cached history and new tokens."""

    hq: int
    hkv: int
    dim: int
    history: tuple[int, ...]
    new: tuple[int, ...]
    window: int | None = None
    softcap: float | None = None
    table_tokens: int = 0  # block tables with room for at least this many tokens (generate's)

    def kv_bytes(self) -> int:
        """Bytes of K and V the class's sequences hold (every one is read at least once)."""
        tokens = sum(h + n for h, n in zip(self.history, self.new, strict=True))
        return 2 * tokens * self.hkv * self.dim * DTYPE.itemsize


CLASSES = {
    # Qwen2-7B attention (28 query / 4 KV heads): speculative verify, 32 rows x 5 draft
    # tokens over 4000 cached; a chunk of 512 over 3000; a ragged prefill of four prompts
    "verify": ExtendClass(28, 4, 128, (4000,) * 32, (5,) * 32),
    "chunked": ExtendClass(28, 4, 128, (3000,), (512,)),
    "ragged": ExtendClass(28, 4, 128, (0, 0, 0, 0), (777, 1500, 2222, 3000)),
    # Gemma-2 attention (16 / 8 heads, head_dim 256, soft-cap 50)
    "d256-softcap": ExtendClass(16, 8, 256, (0, 0), (2048, 2048), softcap=50.0),
    # head_dim 256 without a soft-cap (Gemma-3 4B: 8 / 4 heads): one long prefill, one chunk
    "d256-long": ExtendClass(8, 4, 256, (0,), (8192,)),
    "d256-chunked": ExtendClass(8, 4, 256, (3000,), (512,)),
    # Mistral-like (32 / 8 heads): window 4096 over an 8192-token prefill
    "window": ExtendClass(32, 8, 128, (0,), (8192,), window=4096),
    # Llama-3.2-1B (32 / 8 heads, head_dim 64)
    "d64": ExtendClass(32, 8, 64, (0,) * 8, (2048,) * 8),
    # more of the routes' buckets (Llama-3-8B heads; Gemma-3 12B: 16 / 8, head_dim 256): two
    # chunks over unequal history, one short prompt, a window over two prompts, a short chunk
    "chunked-2x256": ExtendClass(32, 8, 128, (6000, 1500), (256, 256)),
    "short-400": ExtendClass(32, 8, 128, (0,), (400,)),
    "window-2x4096": ExtendClass(32, 8, 128, (0, 0), (4096, 4096), window=2048),
    "d256-chunked-256": ExtendClass(16, 8, 256, (5000,), (256,)),
    # a chunk of a model with few heads (Qwen2.5-1.5B: 12 / 2, head_dim 128): a short grid
    "chunked-256-d128-12h": ExtendClass(12, 2, 128, (3000,), (256,)),
    # chat turns over a shared cached system prompt (the repeated system prompt of issue 14):
    # four rows of 64 new tokens over 2,048 cached, Llama-3.2-1B's heads and Llama-3-8B's
    "turns-4x64-d64": ExtendClass(32, 8, 64, (2048,) * 4, (64,) * 4),
    "turns-4x64-d128": ExtendClass(32, 8, 128, (2048,) * 4, (64,) * 4),
    # short prompts with nothing cached (a batch of 32 prompts of 48 tokens, 1B heads)
    "short-32x48-d64": ExtendClass(32, 8, 64, (0,) * 32, (48,) * 32),
    # the rest of the d64 small-grid, short-sequence bucket (route key ("16bit-d64", 1)): one
    # chat turn, one short prompt, one chunk over history
    "turns-1x64-d64": ExtendClass(32, 8, 64, (2048,), (64,)),
    "short-400-d64": ExtendClass(32, 8, 64, (0,), (400,)),
    "chunked-512-d64": ExtendClass(32, 8, 64, (3000,), (512,)),
    # turns of 17..128 new tokens over history, and the same sizes with nothing cached
    "turns-1x32-d64": ExtendClass(32, 8, 64, (2048,), (32,)),
    "turns-1x64-d64-8k": ExtendClass(32, 8, 64, (8192,), (64,)),
    "turns-2x128-d64": ExtendClass(32, 8, 64, (2048,) * 2, (128,) * 2),
    "turns-32x48-d64": ExtendClass(32, 8, 64, (2048,) * 32, (48,) * 32),
    "turns-1x64-d128": ExtendClass(32, 8, 128, (2048,), (64,)),
    "short-1x64-d64": ExtendClass(32, 8, 64, (0,), (64,)),
    "short-4x64-d64": ExtendClass(32, 8, 64, (0,) * 4, (64,) * 4),
    # turns outside the rule's measured grid: Qwen2-7B heads (GQA 7), two unequal turns
    "turns-2x100-d128-g7": ExtendClass(28, 4, 128, (4096, 1000), (100, 40)),
    # a first prefill in generate: tables sized for the prompt and 1,984 new tokens
    "short-4x64-d64-wide": ExtendClass(32, 8, 64, (0,) * 4, (64,) * 4, table_tokens=2048),
    # verify steps beside the packed kernel's split rule (the forty-sixth session's sweep): a
    # ragged batch, Llama-3-8B heads, and many short MHA programs (the rule's one miss)
    "verify-ragged": ExtendClass(28, 4, 128, tuple(range(500, 8500, 250)), (5,) * 32),
    "verify-16x6-d128": ExtendClass(32, 8, 128, (6000,) * 16, (6,) * 16),
    "verify-mha-d64": ExtendClass(16, 16, 64, (3000,) * 24, (4,) * 24),
}

# nanoserve candidates per head-dim family: ("tiles", (BLOCK_M, BLOCK_N, warps, stages)) is
# the extend kernel at a fixed config, ("packed", (BLOCK_M, BLOCK_N, warps, stages), splits)
# the GQA-packed split-KV kernel (splits None: its default). "auto" (the launcher's own
# routing and autotune, given max_query_len) is always run first.
TILES = {
    64: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2, 128)],
    128: [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 8, 3)],
}
PACKED = {
    64: [((128, 64, 8, 3), None), ((128, 128, 8, 3), None)],
    128: [((128, 64, 8, 3), None), ((64, 64, 4, 3), None), ((128, 64, 8, 3), 2)],
    256: [((64, 32, 4, 2), None), ((64, 64, 8, 2), None), ((128, 32, 8, 2), None)],
}
# block ids a step ahead (TABLE_AHEAD): three stages are then a second K/V buffer (sizes from
# extend_resources.py: two or three programs per SM)
TABLE_AHEAD_TILES = {
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3, 128)],
    128: [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3, 128)],
    256: [(64, 32, 4, 3), (128, 32, 8, 3)],
}
# the few-token case: packed tiles of 64 rows, over split counts
VERIFY = [((64, 64, 4, 3), None), ((64, 64, 4, 2), 4), ((64, 64, 4, 3), 8), ((64, 128, 8, 3), 8),
          ((64, 64, 4, 3), 16)]  # fmt: skip


def parse_extra(text: str) -> dict[str, list[tuple]]:
    """``--extra`` -> {class: [candidate]}: entries split by ";", each
    ``class=tiles:M,N,W,S[,R][:splits]`` (R: a register cap; splits: runs of keys per tile),
    ``class=table-ahead:...`` alike, or ``class=packed:M,N,W,S[:splits]``."""
    extra: dict[str, list[tuple]] = {}
    for entry in filter(None, text.split(";")):
        try:
            name, spec = entry.split("=")
            kind, config, *splits = spec.split(":")
            numbers = tuple(int(x) for x in config.split(","))
            if kind in ("tiles", "table-ahead") and len(splits) <= 1 and len(numbers) in (4, 5):
                candidate: tuple = (kind, numbers, *(int(x) for x in splits))
            elif kind == "packed" and len(splits) <= 1 and len(numbers) == 4:
                candidate = ("packed", numbers, int(splits[0]) if splits else None)
            else:
                raise ValueError(kind)
        except ValueError as e:
            raise ValueError(f"--extra: cannot read {entry!r} ({e})") from None
        extra.setdefault(name, []).append(candidate)
    return extra


def candidates(name: str, cls: ExtendClass, quick: bool) -> list[tuple]:
    """The nanoserve candidates timed on class ``name`` (fewer with ``quick``); any
    ``--extra`` ones come after them."""
    few = triton_extend.few_tokens(max(cls.new))
    out: list[tuple] = [("auto",)]
    if few:
        out += [("auto-no-max-query-len",)]
        out += [("packed", c, s) for c, s in VERIFY]
        out += [("packed-f32-partials", *VERIFY[0])]
        out += [("tiles", TILES[cls.dim][0])]
    else:
        out += [("tiles", c) for c in TILES[cls.dim]]
        out += [("packed", c, s) for c, s in PACKED[cls.dim]]
    if not few:
        out += [("warp-specialized", c) for c in TILES[cls.dim][1:2]]
        out += [("other-order", c) for c in TILES[cls.dim]]
        out += [("table-ahead", c) for c in TABLE_AHEAD_TILES[cls.dim]]
    if cls.softcap is not None:
        out += [("exact-tanh", TILES[cls.dim][0])]
    out = (out[:4] if quick else out) + EXTRA.get(name, [])
    return [c for c in out if not KINDS or c[0] in KINDS]


def label(candidate: tuple) -> str:
    kind, *rest = candidate
    if kind.startswith("packed"):
        config, splits = rest
        return f"{kind} {config} splits {splits or 'auto'}"
    if len(rest) > 1:  # a tiles candidate with key splits
        return f"{kind} {rest[0]} splits {rest[1]}"
    return kind if not rest else f"{kind} {rest[0]}"


def make_set(cls: ExtendClass) -> dict:
    """Pools with the class's sequences on scattered blocks (NaN elsewhere), packed queries."""
    lens = [h + n for h, n in zip(cls.history, cls.new, strict=True)]
    pages = [-(-n // BS) for n in lens]
    width = max(max(pages) + 1, -(-cls.table_tokens // BS))
    total = sum(pages) + 16
    kc = torch.full((total, BS, cls.hkv, cls.dim), float("nan"), dtype=DTYPE, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(total, device="cuda")
    spare = int(perm[-1])
    bt = torch.full((len(lens), width), spare, dtype=torch.int32, device="cuda")
    used = 0
    for i, (n, p) in enumerate(zip(lens, pages, strict=True)):
        ids = perm[used : used + p]
        used += p
        bt[i, :p] = ids.int()
        k = torch.randn(p * BS, cls.hkv, cls.dim, device="cuda").to(DTYPE)
        v = torch.randn(p * BS, cls.hkv, cls.dim, device="cuda").to(DTYPE)
        k[n:] = float("nan")
        v[n:] = float("nan")
        kc[ids] = k.view(p, BS, cls.hkv, cls.dim)
        vc[ids] = v.view(p, BS, cls.hkv, cls.dim)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    new = torch.tensor(cls.new, dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).int()]).cuda()
    q = torch.randn(int(new.sum()), cls.hq, cls.dim, device="cuda").to(DTYPE)
    return dict(q=q, kc=kc, vc=vc, bt=bt, sl=sl, cu=cu, lens=lens, pages=pages)


def reference(cls: ExtendClass, s: dict) -> torch.Tensor:
    """float32 reference (one sequence at a time inside)."""
    return paged_extend_attention_ref(
        s["q"], s["kc"], s["vc"], s["bt"], s["sl"], s["cu"],
        sliding_window=cls.window, softcap=cls.softcap, check=False,
    )  # fmt: skip


def nanoserve_fn(cls: ExtendClass, s: dict, candidate: tuple):
    kind, *rest = candidate
    args = (s["q"], s["kc"], s["vc"], s["bt"], s["sl"], s["cu"])
    opts = dict(sliding_window=cls.window, softcap=cls.softcap)
    if kind in ("auto", "auto-no-max-query-len"):
        max_q = max(cls.new) if kind == "auto" else None
        return lambda: paged_extend_attention(*args, **opts, check=False, max_query_len=max_q)
    if kind == "packed":
        config, splits = rest
        return lambda: paged_extend_attention_packed(
            *args, **opts, scale=cls.dim**-0.5, config=config, num_splits=splits
        )
    return lambda: triton_extend.paged_extend_attention_triton(
        *args, **opts, scale=cls.dim**-0.5, config=rest[0],
        num_splits=rest[1] if len(rest) > 1 else None,
    )  # fmt: skip


def flashinfer_fn(cls: ExtendClass, s: dict, flashinfer):
    """FlashInfer's paged prefill over the same pools (NHD is nanoserve's layout)."""
    workspace = torch.zeros(256 * MIB, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    pages = torch.tensor(s["pages"], dtype=torch.int32)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).int()])
    indices = torch.cat([s["bt"][i, :p] for i, p in enumerate(s["pages"])]).contiguous()
    last = torch.tensor([(n - 1) % BS + 1 for n in s["lens"]], dtype=torch.int32)
    wrapper.plan(
        s["cu"].cpu(), indptr, indices, last, cls.hq, cls.hkv, cls.dim, BS, causal=True,
        sm_scale=cls.dim**-0.5, window_left=(cls.window - 1) if cls.window else -1,
        logits_soft_cap=cls.softcap, q_data_type=DTYPE, kv_data_type=DTYPE,
    )  # fmt: skip
    s["_fi"] = (workspace, wrapper)  # alive as long as the set
    return lambda: wrapper.run(s["q"], (s["kc"], s["vc"]))


def time_us(fns, rep: int) -> tuple[float, str]:
    """Median µs under CUDA-graph replay (eager ``do_bench`` when capture fails)."""
    from triton.testing import do_bench, do_bench_cudagraph

    if rep == 0:  # --check-only
        return math.nan, "not timed"
    fns[0]()  # compile / autotune / plan outside the capture
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(rotating(fns), rep=rep) * 1e3, ""
    except Exception as e:  # a provider that cannot be captured
        note = f"eager ({type(e).__name__})"
        return do_bench(rotating(fns), warmup=10, rep=rep) * 1e3, note


def ratio(us, base) -> str:
    if not isinstance(us, float) or not isinstance(base, float):
        return ""
    return "" if math.isnan(us) or math.isnan(base) else f"{us / base:.2f}"


def log_row(row: dict) -> None:
    """Print one row as it comes, and append it to $OUT/extend_classes_rows.jsonl (kept
    even when the run is cut short)."""
    print(row, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "extend_classes_rows.jsonl"), "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def run_class(name: str, cls: ExtendClass, flashinfer, fi_reason, quick: bool, rep: int):
    """Rows of one class: the read, FlashInfer, then every nanoserve candidate."""
    start = time.time()
    sets = [make_set(cls) for _ in range(num_input_sets(cls.kv_bytes(), MAX_SETS))]
    # on the host: once, a reference kept on the GPU across the timed graphs read back
    # changed (benchmarks/RESULTS.md, twenty-ninth session)
    ref = reference(cls, sets[0]).cpu()
    read_us = ceiling(cls.kv_bytes(), len(sets), graph=True).median if rep else math.nan
    key = triton_extend.route_key(
        sets[0]["q"], len(cls.new), cls.window, cls.softcap, max_query_len=max(cls.new)
    )
    note = f"{cls.kv_bytes() / MIB:.0f} MiB; ROUTES key {key}"
    rows = [dict(candidate="pure_read", us=read_us, note=note)]
    fi_us = math.nan
    if flashinfer is None:
        rows.append(dict(candidate="flashinfer", note=f"not run ({fi_reason})"))
    else:
        try:
            fns = [flashinfer_fn(cls, s, flashinfer) for s in sets]
            err = rel_err(fns[0]().cpu(), ref)
            fi_us, note = time_us(fns, rep)
            rows.append(dict(candidate="flashinfer", us=fi_us, err=f"{err:.1e}", note=note))
        except Exception as e:
            rows.append(dict(candidate="flashinfer", note=f"failed: {str(e)[:70]}"))
    for row in rows:
        log_row({"class": name, **row})
    for candidate in candidates(name, cls, quick):
        row = dict(candidate=label(candidate))
        picked_before = set(triton_extend.autotune_picks())
        try:
            if candidate[0] == "exact-tanh":  # the tiles kernel with the exact tanh
                triton_extend.FAST_TANH = False
                candidate = ("tiles", candidate[1])
            if candidate[0] == "warp-specialized":  # the tiles kernel, WARP_SPECIALIZE on
                triton_extend.WARP_SPECIALIZE = True
                candidate = ("tiles", candidate[1])
            if candidate[0] == "table-ahead":  # the tiles kernel, block ids a step ahead
                triton_extend.TABLE_AHEAD = True
                candidate = ("tiles", *candidate[1:])
            if candidate[0] == "other-order":  # the tiles kernel, the other program order
                family = triton_extend.config_family(cls.dim, DTYPE)
                triton_extend.TILE_MAJOR_FAMILIES = TILE_MAJOR ^ {family}
                candidate = ("tiles", candidate[1])
            if candidate[0] == "packed-f32-partials":  # float32 split partials
                triton_split_merge.PARTIALS_16BIT = False
                candidate = ("packed", *candidate[1:])
            fns = [nanoserve_fn(cls, s, candidate) for s in sets]
            row["err"] = f"{rel_err(fns[0]().cpu(), ref):.1e}"
            row["us"], row["note"] = time_us(fns, rep)
        except Exception as e:  # e.g. out of shared memory for this tile
            row["note"] = f"failed: {type(e).__name__}: {str(e)[:60]}"
        finally:
            triton_extend.FAST_TANH = True
            triton_extend.WARP_SPECIALIZE = False
            triton_extend.TABLE_AHEAD = False
            triton_extend.TILE_MAJOR_FAMILIES = TILE_MAJOR
            triton_split_merge.PARTIALS_16BIT = True
        picks = [f"{c}" for k, c in triton_extend.autotune_picks().items()
                 if k not in picked_before]  # fmt: skip
        if picks:  # what "auto" autotuned to, on its first call for this bucket
            row["note"] = (row.get("note", "") + " autotune picked " + ",".join(picks)).strip()
        rows.append(row)
        log_row({"class": name, **row})
    for row in rows:
        row["class"] = name
        us = row.get("us")
        row["x_flashinfer"] = ratio(us, fi_us)
        row["x_read"] = ratio(us, read_us)
        row["us"] = "" if us is None or math.isnan(us) else f"{us:.1f}"
    del sets
    torch.cuda.empty_cache()
    print(f"{name}: {time.time() - start:.0f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="four candidates per class")
    parser.add_argument("--classes", default=",".join(CLASSES), help="e.g. verify,chunked")
    parser.add_argument("--check-only", action="store_true", help="errors only, no timing")
    parser.add_argument(
        "--extra",
        default="",
        help="more candidates: 'window=tiles:128,64,8,3;verify=packed:64,64,4,3:6'",
    )
    parser.add_argument("--kinds", default="", help="candidate kinds timed, e.g. auto,tiles")
    args = parser.parse_args()
    KINDS.update(filter(None, args.kinds.split(",")))
    names = args.classes.split(",")
    try:
        EXTRA.update(parse_extra(args.extra))
    except ValueError as e:
        parser.error(str(e))
    unknown = [n for n in names + list(EXTRA) if n not in CLASSES]
    if unknown:
        parser.error(f"--classes / --extra: unknown {unknown}; known: {list(CLASSES)}")
    if os.environ.get("OUT"):  # a fresh row log per run
        Path(os.environ["OUT"], "extend_classes_rows.jsonl").unlink(missing_ok=True)
    torch.manual_seed(0)
    print(versions())
    flashinfer, fi_reason = flashinfer_or_reason()
    print(f"flashinfer: {flashinfer.__version__ if flashinfer else fi_reason}")
    rep = 0 if args.check_only else 20 if args.quick else 40
    rows = []
    for name in names:
        rows += run_class(name, CLASSES[name], flashinfer, fi_reason, args.quick, rep)
    show_table(rows, "extend_classes.csv", COLUMNS)


if __name__ == "__main__":
    main()
