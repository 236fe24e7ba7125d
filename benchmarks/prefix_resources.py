"""Registers, spills and shared memory of the shared-prefix pass (``triton_cascade``),
compiled for an NVIDIA architecture without a GPU (Triton's own ptxas and cuobjdump): every
pool dtype and query dtype at the launcher's tiles, so that a change to the pass is known to
compile, and what it costs, before device time is spent.

The installed Triton compiles: its code generation may differ from the device's version (the
H200 has triton 3.6; ``pip install --target DIR triton==3.6.0`` and ``PYTHONPATH=DIR``
match it). Usage:
    python benchmarks/prefix_resources.py [--pools bf16,fp8,int8] [--queries bf16,fp16,fp32]
        [--head-dims 64,128,256] [--group 4] [--arch 90]
Prints one row per (pool, query, head dim): the tile (matrix rows, keys a step, warps),
registers a thread, its stack frame, local memory (spills) and shared memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from decode_resources import POOL_TYPES, SCALE_TYPES  # noqa: E402
from extend_resources import compile_offline, resources  # noqa: E402

from nanoserve.kernels import triton_cascade  # noqa: E402
from nanoserve.kernels.dispatch import head_dim_pad  # noqa: E402
from nanoserve.kernels.quant import INT8_K_GROUP, int8_groups  # noqa: E402
from nanoserve.kernels.shared_prefix import TILE_ROWS  # noqa: E402

QUERY_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def compile_prefix(pool: str, query: str, head_dim: int, group: int, arch: int):
    """(the compiled ``_prefix_kernel`` at the launcher's tiles, (BLOCK_M, BLOCK_N, warps)):
    block size 16, four splits, soft-cap on (the larger program)."""
    fn = triton_cascade._prefix_kernel
    d_pad = head_dim_pad(head_dim)
    rows, sub_tiles, block_m = triton_cascade.prefix_tile_shape(group, pool == "int8")
    block_n, warps = triton_cascade.prefix_key_tile(query == "fp32", d_pad, 16, block_m)
    pointers = dict(query=QUERY_TYPES[query], key_cache=POOL_TYPES[pool],
                    value_cache=POOL_TYPES[pool], block_tables="*i32", prefix_lens="*i32",
                    tiles="*i32", prefix_o="*fp32", prefix_lse="*fp32")  # fmt: skip
    constants = dict(
        GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=16, BLOCK_M=block_m,
        BLOCK_N=block_n, ROWS_PER_PROGRAM=rows, SUB_TILES=sub_tiles, SPLITS=4, TILE=TILE_ROWS,
        HAS_SOFTCAP=True, FP32=query == "fp32", FP8=pool == "fp8", INT8=pool == "int8",
        K_GROUPS=int8_groups(head_dim, INT8_K_GROUP), K_GW=INT8_K_GROUP, PDL=True,
    )  # fmt: skip
    if pool in SCALE_TYPES:
        pointers.update(k_scale=SCALE_TYPES[pool], v_scale=SCALE_TYPES[pool])
    else:
        constants.update(k_scale=None, v_scale=None)
    if pool == "bf16":  # 16-bit pools hold the query's dtype
        pointers.update(key_cache=QUERY_TYPES[query], value_cache=QUERY_TYPES[query])
    aligned = [name for name in fn.arg_names if name.startswith("stride")]
    options = dict(num_warps=warps, num_stages=2)
    kernel = compile_offline(fn, pointers, constants, aligned, arch, options)
    return kernel, (block_m, block_n, warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="bf16,fp8,int8", help="bf16: the query's dtype")
    parser.add_argument("--queries", default="bf16,fp16,fp32")
    parser.add_argument("--head-dims", default="64,80,128,256")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    print("| pool | query | head dim | tile | registers | stack bytes | spill bytes | shared KiB |")
    print("|---|---|---|---|---|---|---|---|")
    for pool in args.pools.split(","):
        for query in args.queries.split(","):
            for head_dim in (int(d) for d in args.head_dims.split(",")):
                kernel, tile = compile_prefix(pool, query, head_dim, args.group, args.arch)
                used = resources(kernel)
                print(
                    f"| {pool} | {query} | {head_dim} | {tile} | {used['registers']} | "
                    f"{used['stack']} | {used['local']} | {used['shared'] / 1024:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
