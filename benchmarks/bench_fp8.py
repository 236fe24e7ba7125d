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

    python3 benchmarks/bench_fp8.py [--errors-only | --speed-only | --sweep | --sweep-int8]
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


def int8_pool_bytes(batch: int, ctx: int, hkv: int, dim: int = DIM) -> int:
    """Bytes of INT8 K/V for ``batch`` rows of ``ctx`` tokens of head dim ``dim``: the values,
    and float16 scales per 16 key channels and one per value head."""
    return batch * ctx * hkv * (2 * dim + 2 * (-(-dim // 16) + 1))


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
    args = parser.parse_args()
    print(versions())
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
