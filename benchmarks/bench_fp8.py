"""FP8 and INT8 KV decode on the GPU: error against float32 K/V as the context grows, and
speed of bf16 pools vs FP8 pools vs INT8 pools vs a pure read of their bytes (and FlashInfer's
FP8 decode when it imports).

Error: batch 1, 32 query / 8 KV heads, head_dim 128, contexts 1k..128k; random K/V whose
per-head magnitudes differ, FP8 scales per KV head from the amax; relative error of the
bf16-query decode over FP8 pools (and over bf16 pools, for scale) against the float32
reference over the unquantized K/V. Flat with length is the goal.

Speed (median µs under CUDA-graph replay, input sets rotated past the L2): 32 x 8192 and
128 x 2048 (32/8 heads), 1 x 32768 (32/8 and 28/4 heads), head_dim 128, block size 16, blocks
scattered at random. Columns: bf16_us, fp8_us, read_fp8_us (a pure read of the FP8 pool's
bytes), speedup = bf16 / fp8, x_read = fp8 / read_fp8, flashinfer_fp8_us, and
fp8_prev_plan_us: the FP8 launch as planned before the register cap (128-token tiles, three
stages, the compiler's registers), for comparison in the same run. INT8 pools (values and
float16 scales per 16 channels): int8_us, read_int8_us (a pure read of their values and
scales), int8_speedup = bf16 / int8, int8_x_read. Goals: speedup >= 1.8 at >= 1 GB of
bf16-equivalent K/V, x_read <= 1.15, 1 x 32k speedup >= 1.6.

    python3 benchmarks/bench_fp8.py [--errors-only | --speed-only | --sweep | --sweep-int8
        | --sweep-ahead | --sweep-two-warps | --layout | --int8-plan]
        [--max-context 131072]

Prints two tables; with $OUT set, writes fp8_error.csv and fp8_speed.csv there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("bench_fp8")

from harness import ceiling, num_input_sets, rel_err, show_table, time_graph, versions  # noqa: E402

from nanoserve.kernels import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.quant import FP8_DTYPE, FP8_MAX, quantize, quantize_int8  # noqa: E402

BS, DIM = 16, 128
BF16 = torch.bfloat16
SPEED_SHAPES = [  # (batch, context, query heads, KV heads)
    (32, 8192, 32, 8),
    (1, 32768, 32, 8),
    (1, 32768, 28, 4),
    (128, 2048, 32, 8),
]
MIB = 2**20


def head_magnitudes(hkv: int) -> torch.Tensor:
    """Per-KV-head magnitudes 0.3x..3x (real K has heads of very different ranges)."""
    return torch.logspace(-0.5, 0.5, hkv, device="cuda")[:, None]


def error_rows(max_context: int) -> list[dict]:
    rows = []
    hq, hkv = 32, 8
    ctx = 1024
    while ctx <= max_context:
        torch.manual_seed(ctx)
        key = torch.randn(ctx, hkv, DIM, device="cuda") * head_magnitudes(hkv)
        value = torch.randn(ctx, hkv, DIM, device="cuda") * head_magnitudes(hkv)
        q = (torch.randn(1, hq, DIM, device="cuda") * 2).to(BF16)
        bt = torch.arange(ctx // BS, dtype=torch.int32, device="cuda")[None]
        sl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        pools = (-1, BS, hkv, DIM)
        ref = paged_decode_attention_ref(q.float(), key.view(pools), value.view(pools), bt, sl)
        bf16 = paged_decode_attention(q, key.to(BF16).view(pools), value.to(BF16).view(pools),
                                      bt, sl)  # fmt: skip
        ks = key.abs().amax(dim=(0, 2)) / FP8_MAX
        vs = value.abs().amax(dim=(0, 2)) / FP8_MAX
        kc, vc = quantize(key, ks).view(pools), quantize(value, vs).view(pools)
        fp8 = paged_decode_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=vs)
        k8, ks8 = quantize_int8(key.view(pools))
        v8, vs8 = quantize_int8(value.view(pools), group=None)
        int8 = paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks8, v_scale=vs8)
        rows.append(dict(context=ctx, fp8_err=f"{rel_err(fp8, ref):.2e}",
                         int8_err=f"{rel_err(int8, ref):.2e}",
                         bf16_err=f"{rel_err(bf16, ref):.2e}"))  # fmt: skip
        print(rows[-1], flush=True)
        del key, value, kc, vc, k8, v8
        ctx *= 2
    return rows


def make_set(batch: int, ctx: int, hq: int, hkv: int) -> dict:
    used = batch * ctx // BS
    total = used + 64
    kc = torch.randn(total, BS, hkv, DIM, device="cuda", dtype=BF16)
    vc = torch.randn(total, BS, hkv, DIM, device="cuda", dtype=BF16)
    ks = torch.full((hkv,), 4.0 / FP8_MAX, device="cuda")
    vs = ks.clone()
    k8 = quantize(kc.view(-1, hkv, DIM), ks).view(kc.shape)
    v8 = quantize(vc.view(-1, hkv, DIM), vs).view(kc.shape)
    bt = torch.randperm(total, device="cuda")[:used].view(batch, ctx // BS).int().contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, DIM, device="cuda", dtype=BF16)
    ki, kis = quantize_int8(kc)
    vi, vis = quantize_int8(vc, group=None)
    return dict(q=q, kc=kc, vc=vc, k8=k8, v8=v8, ks=ks, vs=vs, bt=bt, sl=sl,
                ki=ki, vi=vi, kis=kis, vis=vis)  # fmt: skip


def int8_pool_bytes(batch: int, ctx: int, hkv: int) -> int:
    """Bytes of INT8 K/V for ``batch`` rows of ``ctx`` tokens: the values, and float16 scales
    per 16 key channels and one per value head."""
    return batch * ctx * hkv * (2 * DIM + 2 * (-(-DIM // 16) + 1))


def int8_decode(s: dict, config=None, splits=None):
    """The decode launch over the set's INT8 pools (the default plan unless given)."""
    from nanoserve.kernels.triton_decode import paged_decode_attention_triton

    return lambda: paged_decode_attention_triton(
        s["q"], s["ki"], s["vi"], s["bt"], s["sl"], scale=DIM**-0.5, sliding_window=None,
        softcap=None, num_splits=splits, config=config, k_scale=s["kis"], v_scale=s["vis"],
    )  # fmt: skip


def flashinfer_fp8(s: dict, hq: int, hkv: int):
    """FlashInfer's paged decode over the FP8 pools (one scale per tensor), or a reason."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a broken install raising anything else
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:80]
    batch, pages = s["bt"].shape
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
    indices = s["bt"].flatten().contiguous()
    last = torch.full((batch,), BS, dtype=torch.int32, device="cuda")
    reasons = []
    for tensor_cores in (True, False):
        try:
            workspace = torch.zeros(128 * MIB, dtype=torch.uint8, device="cuda")
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores
            )
            wrapper.plan(indptr, indices, last, hq, hkv, DIM, BS,
                         q_data_type=BF16, kv_data_type=FP8_DTYPE)  # fmt: skip
            scale = float(s["ks"][0])

            def run(wrapper=wrapper, workspace=workspace, scale=scale):
                return wrapper.run(s["q"], (s["k8"], s["v8"]), k_scale=scale, v_scale=scale)

            run()
            return run, f"tensor_cores={tensor_cores}"
        except Exception as e:  # an API or dtype this version lacks: say so
            reasons.append(f"{type(e).__name__}: {str(e)[:60]}")
    return None, "; ".join(reasons)


def speed_rows(shapes) -> list[dict]:
    rows = []
    for batch, ctx, hq, hkv in shapes:
        bf16_bytes = batch * ctx * hkv * DIM * 2 * 2
        fp8_bytes = bf16_bytes // 2
        int8_bytes = int8_pool_bytes(batch, ctx, hkv)
        torch.cuda.empty_cache()
        sets = [make_set(batch, ctx, hq, hkv) for _ in range(num_input_sets(fp8_bytes, 8))]

        def bf16(s):
            return lambda: paged_decode_attention(s["q"], s["kc"], s["vc"], s["bt"], s["sl"],
                                                  check=False)  # fmt: skip

        def fp8(s):
            return lambda: paged_decode_attention(s["q"], s["k8"], s["v8"], s["bt"], s["sl"],
                                                  k_scale=s["ks"], v_scale=s["vs"],
                                                  check=False)  # fmt: skip

        def fp8_prev_plan(s):
            from nanoserve.kernels.triton_decode import paged_decode_attention_triton

            return lambda: paged_decode_attention_triton(
                s["q"], s["k8"], s["v8"], s["bt"], s["sl"], scale=DIM**-0.5,
                sliding_window=None, softcap=None, config=(128, 4, 3),
                k_scale=s["ks"], v_scale=s["vs"],
            )  # fmt: skip

        s0 = sets[0]
        n = min(4, batch)
        ref = paged_decode_attention_ref(
            s0["q"][:n].float(), s0["k8"], s0["v8"], s0["bt"][:n], s0["sl"][:n],
            k_scale=s0["ks"], v_scale=s0["vs"],
        )  # fmt: skip
        err = rel_err(fp8(s0)()[:n], ref)
        ref8 = paged_decode_attention_ref(
            s0["q"][:n].float(), s0["ki"], s0["vi"], s0["bt"][:n], s0["sl"][:n],
            k_scale=s0["kis"], v_scale=s0["vis"],
        )  # fmt: skip
        err8 = rel_err(int8_decode(s0)()[:n], ref8)
        t_int8 = time_graph([int8_decode(s) for s in sets]).median
        t_read8 = ceiling(int8_bytes, len(sets), graph=True).median
        t_bf16 = time_graph([bf16(s) for s in sets]).median
        t_fp8 = time_graph([fp8(s) for s in sets]).median
        t_prev = time_graph([fp8_prev_plan(s) for s in sets]).median
        t_read = ceiling(fp8_bytes, len(sets), graph=True).median
        fi, why = flashinfer_fp8(s0, hq, hkv)
        t_fi = time_graph([fi]).median if fi is not None else None
        row = dict(shape=f"{batch}x{ctx} {hq}/{hkv}", bf16_MiB=round(bf16_bytes / MIB),
                   bf16_us=round(t_bf16, 1), fp8_us=round(t_fp8, 1),
                   read_fp8_us=round(t_read, 1), speedup=round(t_bf16 / t_fp8, 2),
                   x_read=round(t_fp8 / t_read, 2), fp8_GBps=round(fp8_bytes / t_fp8 / 1e3),
                   flashinfer_fp8_us="" if t_fi is None else round(t_fi, 1),
                   fp8_prev_plan_us=round(t_prev, 1), int8_us=round(t_int8, 1),
                   read_int8_us=round(t_read8, 1), int8_speedup=round(t_bf16 / t_int8, 2),
                   int8_x_read=round(t_int8 / t_read8, 2), flashinfer=why,
                   fp8_err=f"{err:.1e}", int8_err=f"{err8:.1e}")  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        del sets
    return rows


def sweep_rows(shapes) -> list[dict]:
    """FP8 decode over (BLOCK_N, num_warps, num_stages), register caps and split counts: FP8
    tiles are half the bytes of bf16's, so the bf16-tuned tile may not be FP8's best."""
    from nanoserve.kernels import triton_decode

    planned = triton_decode.decode_plan
    rows = []
    configs = [None, (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2)]
    for batch, ctx, hq, hkv in shapes:
        fp8_bytes = batch * ctx * hkv * DIM * 2
        torch.cuda.empty_cache()
        sets = [make_set(batch, ctx, hq, hkv) for _ in range(num_input_sets(fp8_bytes, 8))]
        default = planned(sets[0]["q"], sets[0]["k8"], sets[0]["bt"])
        for config in configs:
            for registers in (None,) if config is None else (0, 128):
                for splits in (None, 2 * default.num_splits) if default.num_splits else (None,):

                    def plan(*args, registers=registers, **kwargs):
                        chosen = planned(*args, **kwargs)
                        if registers is None:
                            return chosen
                        return chosen._replace(max_registers=registers)

                    def fn(s, config=config, splits=splits):
                        return lambda: triton_decode.paged_decode_attention_triton(
                            s["q"], s["k8"], s["v8"], s["bt"], s["sl"], scale=DIM**-0.5,
                            sliding_window=None, softcap=None, num_splits=splits,
                            config=config, k_scale=s["ks"], v_scale=s["vs"],
                        )  # fmt: skip

                    triton_decode.decode_plan = plan
                    try:
                        us = time_graph([fn(s) for s in sets]).median
                    finally:
                        triton_decode.decode_plan = planned
                    rows.append(dict(shape=f"{batch}x{ctx} {hq}/{hkv}",
                                     config=config or "default", maxnreg=registers,
                                     splits=splits or "auto", fp8_us=round(us, 1),
                                     fp8_GBps=round(fp8_bytes / us / 1e3),
                                     default_plan=str(default)))  # fmt: skip
                    print(rows[-1], flush=True)
        del sets
    return rows


# (label, kind, (BLOCK_N, num_warps, num_stages) or None, register cap or None, ids ahead or
# None): None keeps the launcher's own choice
AHEAD_CANDIDATES = [
    ("fp8 default", "fp8", None, None, None),
    ("fp8 128/4/3 cap128 ahead", "fp8", (128, 4, 3), 128, True),
    ("fp8 128/4/3 ahead", "fp8", (128, 4, 3), 0, True),
    ("fp8 128/4/4 cap128 ahead", "fp8", (128, 4, 4), 128, True),
    ("fp8 64/4/3 cap128 ahead", "fp8", (64, 4, 3), 128, True),
    ("fp8 64/4/3 ahead", "fp8", (64, 4, 3), 0, True),
    ("fp8 64/4/4 cap128 ahead", "fp8", (64, 4, 4), 128, True),
    ("fp8 128/8/3 ahead", "fp8", (128, 8, 3), 0, True),
    ("int8 default", "int8", None, None, None),
    ("int8 64/4/3 ahead", "int8", (64, 4, 3), 0, True),
    ("int8 64/4/3 cap128 ahead", "int8", (64, 4, 3), 128, True),
    ("int8 32/4/3 ahead", "int8", (32, 4, 3), 0, True),
]


# Two-warp programs: twice the programs an SM for the same registers, more of them to hide
# each one's chain of dependent steps (conversion, product, softmax, product).
TWO_WARP_CANDIDATES = [
    ("fp8 default", "fp8", None, None, None),
    ("fp8 64/2/2", "fp8", (64, 2, 2), 0, False),
    ("fp8 64/2/2 cap128", "fp8", (64, 2, 2), 128, False),
    ("fp8 64/2/3 ahead", "fp8", (64, 2, 3), 0, True),
    ("fp8 128/2/2", "fp8", (128, 2, 2), 0, False),
    ("fp8 32/2/2", "fp8", (32, 2, 2), 0, False),
    ("int8 default", "int8", None, None, None),
    ("int8 64/2/2", "int8", (64, 2, 2), 0, False),
    ("int8 64/2/3 ahead", "int8", (64, 2, 3), 0, True),
]


def sweep_ahead_rows(shapes, candidates=AHEAD_CANDIDATES) -> list[dict]:
    """FP8 and INT8 decode over ``candidates``: by default with the block ids a loop step
    ahead (``DecodePlan.table_ahead``) over tiles, stages and register caps, each checked
    against the float32 reference of the quantized pools: the one-byte kernels compute
    longer per byte than bf16's, so a second K/V buffer in flight may pay there where it did
    not for bf16."""
    from nanoserve.kernels import triton_decode

    planned = triton_decode.decode_plan
    rows = []
    for batch, ctx, hq, hkv in shapes:
        fp8_bytes = batch * ctx * hkv * DIM * 2
        torch.cuda.empty_cache()
        sets = [make_set(batch, ctx, hq, hkv) for _ in range(num_input_sets(fp8_bytes, 8))]
        s0, n = sets[0], min(4, batch)
        pools = {"fp8": ("k8", "v8", "ks", "vs"), "int8": ("ki", "vi", "kis", "vis")}
        refs = {}
        for kind, (k, v, ks, vs) in pools.items():
            refs[kind] = paged_decode_attention_ref(
                s0["q"][:n].float(), s0[k], s0[v], s0["bt"][:n], s0["sl"][:n],
                k_scale=s0[ks], v_scale=s0[vs],
            )  # fmt: skip
        base = {}
        for label, kind, config, registers, ahead in candidates:
            k, v, ks, vs = pools[kind]

            def plan(*args, registers=registers, ahead=ahead, **kwargs):
                chosen = planned(*args, **kwargs)
                if registers is not None:
                    chosen = chosen._replace(max_registers=registers)
                return chosen if ahead is None else chosen._replace(table_ahead=ahead)

            def fn(s, config=config, k=k, v=v, ks=ks, vs=vs):
                return lambda: triton_decode.paged_decode_attention_triton(
                    s["q"], s[k], s[v], s["bt"], s["sl"], scale=DIM**-0.5,
                    sliding_window=None, softcap=None, config=config,
                    k_scale=s[ks], v_scale=s[vs],
                )  # fmt: skip

            triton_decode.decode_plan = plan
            try:
                chosen = str(plan(s0["q"], s0[k], s0["bt"], config))
                err = rel_err(fn(s0)()[:n], refs[kind])
                us = time_graph([fn(s) for s in sets]).median
            except Exception as e:  # a tile that does not fit: say so, go on
                chosen, err, us = f"{type(e).__name__}: {str(e)[:60]}", float("nan"), float("nan")
            finally:
                triton_decode.decode_plan = planned
            base.setdefault(kind, us)
            rows.append(dict(shape=f"{batch}x{ctx} {hq}/{hkv}", candidate=label,
                             us=round(us, 1), x_default=round(us / base[kind], 3),
                             GBps=round(fp8_bytes / us / 1e3), err=f"{err:.1e}",
                             plan=chosen))  # fmt: skip
            print(rows[-1], flush=True)
        del sets
    return rows


def head_major(pool: torch.Tensor) -> torch.Tensor:
    """The same [blocks, block_size, KV heads, D] values stored head-major (each block's
    tokens of one KV head contiguous, as FlashInfer's "HND"): a strided view of that copy."""
    return pool.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def layout_rows(shapes) -> list[dict]:
    """Decode over pools stored token-major (the pools' layout: a token's KV heads side by
    side, so one KV head's token row is D elements between other heads') against the same
    values stored head-major (a block's tokens of one KV head contiguous), through the
    kernel's strides: whether FP8's 128-byte rows, half of bf16's 256, cost read speed."""
    from nanoserve.kernels import triton_decode

    rows = []
    for batch, ctx, hq, hkv in shapes:
        fp8_bytes = batch * ctx * hkv * DIM * 2
        torch.cuda.empty_cache()
        sets = [make_set(batch, ctx, hq, hkv) for _ in range(num_input_sets(fp8_bytes, 8))]
        for s in sets:
            for name in ("kc", "vc", "k8", "v8"):
                s[name + "_hnd"] = head_major(s[name])
            del s["ki"], s["vi"], s["kis"], s["vis"]
        s0, n = sets[0], min(4, batch)
        fp8_scales = dict(k_scale=s0["ks"], v_scale=s0["vs"])
        refs = {}
        for kind, k, v in (("bf16", "kc", "vc"), ("fp8", "k8", "v8")):
            k_pool, v_pool = (s0[k], s0[v]) if kind == "fp8" else (s0[k].float(), s0[v].float())
            refs[kind] = paged_decode_attention_ref(
                s0["q"][:n].float(), k_pool, v_pool, s0["bt"][:n], s0["sl"][:n],
                **(fp8_scales if kind == "fp8" else {}),
            )  # fmt: skip
        t_read = ceiling(fp8_bytes, len(sets), graph=True).median
        for kind, k, v in (("bf16", "kc", "vc"), ("fp8", "k8", "v8")):
            for layout in ("", "_hnd"):
                for config in (None, (64, 4, 2)) if kind == "fp8" else (None,):

                    def fn(s, kind=kind, k=k + layout, v=v + layout, config=config):
                        scales = dict(k_scale=s["ks"], v_scale=s["vs"]) if kind == "fp8" else {}
                        return lambda: triton_decode.paged_decode_attention_triton(
                            s["q"], s[k], s[v], s["bt"], s["sl"], scale=DIM**-0.5,
                            sliding_window=None, softcap=None, config=config, **scales,
                        )  # fmt: skip

                    err = rel_err(fn(sets[0])()[:n], refs[kind])
                    us = time_graph([fn(s) for s in sets]).median
                    rows.append(dict(shape=f"{batch}x{ctx} {hq}/{hkv}", kv=kind,
                                     layout="head-major" if layout else "token-major",
                                     config=config or "default", us=round(us, 1),
                                     read_fp8_us=round(t_read, 1),
                                     x_read_fp8=round(us / t_read, 2),
                                     err=f"{err:.1e}"))  # fmt: skip
                    print(rows[-1], flush=True)
        del sets
    return rows


INT8_PLAN_SHAPES = [  # (batch, context, query heads, KV heads, head dim)
    (128, 2048, 32, 8, 128),
    (256, 512, 28, 4, 128),
    (8, 4096, 32, 8, 128),
    (1, 32768, 32, 8, 128),
    (32, 8192, 32, 8, 128),
    (64, 1024, 32, 8, 64),
    (1, 16384, 32, 8, 64),
    (16, 2048, 32, 8, 80),
]


def int8_set(batch: int, ctx: int, hq: int, hkv: int, dim: int) -> dict:
    """INT8 pools (key scales per 16 channels, one value scale a slot) of ``batch`` rows of
    ``ctx`` tokens over blocks scattered at random, and a bf16 query."""
    used = batch * ctx // BS
    kc = torch.randn(used + 64, BS, hkv, dim, device="cuda", dtype=BF16)
    ki, kis = quantize_int8(kc)
    vi, vis = quantize_int8(torch.randn_like(kc), group=None)
    bt = torch.randperm(used + 64, device="cuda")[:used].view(batch, -1).int().contiguous()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, dim, device="cuda", dtype=BF16)
    return dict(q=q, ki=ki, vi=vi, kis=kis, vis=vis, bt=bt, sl=sl)


def int8_plan_rows(shapes) -> list[dict]:
    """INT8 decode by the launcher's plan against the plan before block ids ahead (same
    tile, ids loaded in the loop, two stages for split launches), same process."""
    from nanoserve.kernels import triton_decode

    planned = triton_decode.decode_plan

    def previous(query, key_cache, *args, **kwargs):
        plan = planned(query, key_cache, *args, **kwargs)
        if not plan.table_ahead:
            return plan
        stages = triton_decode.decode_config(query.shape[2], key_cache.shape[1], query.dtype)[2]
        stages = min(stages, 2) if plan.num_splits > 1 else stages
        return plan._replace(table_ahead=False, num_stages=stages)

    rows = []
    for batch, ctx, hq, hkv, dim in shapes:
        int8_bytes = batch * ctx * hkv * (2 * dim + 2 * (-(-dim // 16) + 1))
        torch.cuda.empty_cache()

        sets = [int8_set(batch, ctx, hq, hkv, dim) for _ in range(num_input_sets(int8_bytes, 8))]
        s0, n = sets[0], min(4, batch)
        ref = paged_decode_attention_ref(
            s0["q"][:n].float(), s0["ki"], s0["vi"], s0["bt"][:n], s0["sl"][:n],
            k_scale=s0["kis"], v_scale=s0["vis"],
        )  # fmt: skip

        def fn(s, dim=dim):
            return lambda: triton_decode.paged_decode_attention_triton(
                s["q"], s["ki"], s["vi"], s["bt"], s["sl"], scale=dim**-0.5,
                sliding_window=None, softcap=None, k_scale=s["kis"], v_scale=s["vis"],
            )  # fmt: skip

        found = {}
        for name, plan in (("now", planned), ("before", previous), ("now again", planned)):
            triton_decode.decode_plan = plan
            try:
                err = rel_err(fn(s0)()[:n], ref)
                us = time_graph([fn(s) for s in sets]).median
                chosen = plan(s0["q"], s0["ki"], s0["bt"])
            finally:
                triton_decode.decode_plan = planned
            found[name] = (us, err, chosen)
        t_read = ceiling(int8_bytes, len(sets), graph=True).median
        now = min(found["now"][0], found["now again"][0])
        rows.append(dict(shape=f"{batch}x{ctx} {hq}/{hkv} d{dim}",
                         now_us=f"{found['now'][0]:.1f} / {found['now again'][0]:.1f}",
                         before_us=round(found["before"][0], 1),
                         now_x_before=round(now / found["before"][0], 3),
                         read_us=round(t_read, 1), now_x_read=round(now / t_read, 2),
                         err=f"{found['now'][1]:.1e} / {found['before'][1]:.1e}",
                         plan=f"{tuple(found['now'][2])} / {tuple(found['before'][2])}",
                         ))  # fmt: skip
        print(rows[-1], flush=True)
        del sets
    return rows


def sweep_int8_rows(shapes) -> list[dict]:
    """INT8 decode over (BLOCK_N, num_warps, num_stages) and split counts."""
    rows = []
    configs = [None, (32, 4, 2), (64, 4, 2), (128, 4, 2), (128, 8, 2)]
    for batch, ctx, hq, hkv in shapes:
        int8_bytes = int8_pool_bytes(batch, ctx, hkv)
        torch.cuda.empty_cache()
        sets = [make_set(batch, ctx, hq, hkv) for _ in range(num_input_sets(int8_bytes, 8))]
        for config in configs:
            for splits in (None, 4):
                fns = [int8_decode(s, config, splits) for s in sets]
                us = time_graph(fns).median
                rows.append(dict(shape=f"{batch}x{ctx} {hq}/{hkv}", config=config or "default",
                                 splits=splits or "auto", int8_us=round(us, 1),
                                 int8_GBps=round(int8_bytes / us / 1e3)))  # fmt: skip
                print(rows[-1], flush=True)
        del sets
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--errors-only", action="store_true")
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--max-context", type=int, default=131072)
    parser.add_argument("--sweep", action="store_true", help="only FP8 decode configs")
    parser.add_argument("--sweep-int8", action="store_true", help="only INT8 decode configs")
    parser.add_argument("--sweep-ahead", action="store_true",
                        help="only FP8 / INT8 decode with the block ids a step ahead")  # fmt: skip
    parser.add_argument("--sweep-two-warps", action="store_true",
                        help="only FP8 / INT8 decode in two-warp programs")  # fmt: skip
    parser.add_argument("--layout", action="store_true",
                        help="only decode over token-major against head-major pools")  # fmt: skip
    parser.add_argument("--int8-plan", action="store_true",
                        help="only INT8 decode: the plan against the one before")  # fmt: skip
    args = parser.parse_args()
    print(versions())
    if args.int8_plan:
        show_table(int8_plan_rows(INT8_PLAN_SHAPES), "int8_plan.csv")
        return
    if args.layout:
        show_table(layout_rows(SPEED_SHAPES + [(8, 4096, 32, 8)]), "decode_layout.csv")
        return
    if args.sweep_two_warps:
        rows = sweep_ahead_rows(SPEED_SHAPES + [(8, 4096, 32, 8)], TWO_WARP_CANDIDATES)
        show_table(rows, "fp8_sweep_two_warps.csv")
        return
    if args.sweep_ahead:
        show_table(sweep_ahead_rows(SPEED_SHAPES + [(8, 4096, 32, 8)]), "fp8_sweep_ahead.csv")
        return
    if args.sweep_int8:
        show_table(sweep_int8_rows(SPEED_SHAPES[:3]), "int8_sweep.csv")
        return
    if args.sweep:
        show_table(sweep_rows(SPEED_SHAPES + [(8, 4096, 32, 8)]), "fp8_sweep.csv")
        return
    errors = [] if args.speed_only else error_rows(args.max_context)
    speed = [] if args.errors_only else speed_rows(SPEED_SHAPES)
    if errors:
        show_table(errors, "fp8_error.csv")
    if speed:
        show_table(speed, "fp8_speed.csv")


if __name__ == "__main__":
    main()
