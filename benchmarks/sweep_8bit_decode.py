"""Launch plans of FP8 and INT8 decode on the GPU, each checked and timed.

Each candidate is checked against the float32 reference of the quantized pools and timed
under CUDA-graph replay with input sets rotated past the L2 (the shapes of ``bench_fp8.py``):

- ``--ahead``: block ids loaded a loop step ahead (``DecodePlan.table_ahead``) over tiles,
  stages and register caps;
- ``--two-warps``: two-warp programs;
- ``--layout``: bf16 and FP8 pools stored token-major (the pools' layout) against the same
  values head-major, through the kernels' strides;
- ``--int8-plan``: INT8 decode by the launcher's plan against the plan before the ids ahead.

    python3 benchmarks/sweep_8bit_decode.py --ahead | --two-warps | --layout | --int8-plan

Prints a table; with $OUT set, writes its csv there.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

require_cuda("sweep_8bit_decode")

from bench_fp8 import BF16, BS, DIM, SPEED_SHAPES, int8_pool_bytes, make_set  # noqa: E402
from harness import ceiling, num_input_sets, rel_err, show_table, time_graph, versions  # noqa: E402

from nanoserve.kernels import paged_decode_attention_ref  # noqa: E402
from nanoserve.kernels.quant import quantize_int8  # noqa: E402

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


@contextlib.contextmanager
def launched_by(plan):
    """The decode launcher plans with ``plan`` (``decode_plan``'s signature) inside."""
    from nanoserve.kernels import triton_decode

    planned = triton_decode.decode_plan
    triton_decode.decode_plan = plan
    try:
        yield
    finally:
        triton_decode.decode_plan = planned


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

            try:
                with launched_by(plan):
                    chosen = str(plan(s0["q"], s0[k], s0["bt"], config))
                    err = rel_err(fn(s0)()[:n], refs[kind])
                    us = time_graph([fn(s) for s in sets]).median
            except Exception as e:  # a tile that does not fit: say so, go on
                chosen, err, us = f"{type(e).__name__}: {str(e)[:60]}", float("nan"), float("nan")
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
        int8_bytes = int8_pool_bytes(batch, ctx, hkv, dim)
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
            with launched_by(plan):
                err = rel_err(fn(s0)()[:n], ref)
                us = time_graph([fn(s) for s in sets]).median
                chosen = plan(s0["q"], s0["ki"], s0["bt"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_mutually_exclusive_group(required=True)
    modes.add_argument("--ahead", action="store_true", help="block ids a step ahead")
    modes.add_argument("--two-warps", action="store_true", help="two-warp programs")
    modes.add_argument("--layout", action="store_true", help="token- against head-major")
    modes.add_argument("--int8-plan", action="store_true", help="INT8: plan against before")
    args = parser.parse_args()
    print(versions())
    shapes = SPEED_SHAPES + [(8, 4096, 32, 8)]
    if args.int8_plan:
        show_table(int8_plan_rows(INT8_PLAN_SHAPES), "int8_plan.csv")
    elif args.layout:
        show_table(layout_rows(shapes), "decode_layout.csv")
    elif args.two_warps:
        show_table(sweep_ahead_rows(shapes, TWO_WARP_CANDIDATES), "fp8_sweep_two_warps.csv")
    else:
        show_table(sweep_ahead_rows(shapes), "fp8_sweep_ahead.csv")


if __name__ == "__main__":
    main()
