"""Registers, spills and the loop's instruction mix of the split decode kernel, compiled for an
NVIDIA architecture without a GPU (Triton's own ptxas and cuobjdump): what a loop step costs
for 16-bit, FP8 and INT8 pools before device time is spent (see benchmarks/RESULTS.md,
2026-12-04, twenty-ninth session: FP8's V tile leaves shared memory a byte at a time).

The installed Triton compiles: its code generation may differ from the device's version (the
H200 has triton 3.6; ``pip install --target DIR triton==3.6.0`` and ``PYTHONPATH=DIR``
match it). Usage:
    python benchmarks/decode_resources.py [--pools bf16,fp8,int8] [--head-dim 128]
        [--group 4] [--config 128,4,2] [--maxnreg 128] [--table-ahead 0|1] [--arch 90]
        [--top 12]
Prints one row per pool dtype: the tile config, registers a thread, local memory (spills),
instructions in the kernel and in its longest loop, and the loop's most frequent opcodes.
``--config``, ``--maxnreg`` and ``--table-ahead`` default to ``decode_plan``'s choice for a
long split row.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from extend_resources import compile_offline, cuobjdump, resources  # noqa: E402

from nanoserve.kernels import triton_decode  # noqa: E402
from nanoserve.kernels.dispatch import head_dim_pad  # noqa: E402
from nanoserve.kernels.quant import FP8_DTYPE, INT8_DTYPE, INT8_K_GROUP, int8_groups  # noqa: E402

POOL_TYPES = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}
POOL_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE, "int8": INT8_DTYPE}
SCALE_TYPES = {"fp8": "*fp32", "int8": "*fp16"}
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*?);")


def default_plan(pool: str, head_dim: int, group: int) -> triton_decode.DecodePlan:
    """decode_plan's choice for one row of 32k tokens over 8 KV heads (a split launch)."""
    num_kv_heads, block_size = 8, 16
    query = torch.empty(1, num_kv_heads * group, head_dim, dtype=torch.bfloat16)
    key_cache = torch.empty(1, block_size, num_kv_heads, head_dim, dtype=POOL_DTYPES[pool])
    tables = torch.empty(1, 32768 // block_size, dtype=torch.int32)
    return triton_decode.decode_plan(query, key_cache, tables, num_splits=4)


def compile_decode(
    pool: str, head_dim: int, group: int, config, maxnreg: int, arch: int, table_ahead: bool
):
    """The compiled ``_decode_kernel`` (fixed splits, bf16 query, block size 16)."""
    fn = triton_decode._decode_kernel
    block_n, warps, stages = config
    quantized = pool in SCALE_TYPES
    pointers = dict(query="*bf16", key_cache=POOL_TYPES[pool], value_cache=POOL_TYPES[pool],
                    block_tables="*i32", seq_lens="*i32", out="*bf16", mid_o="*fp32",
                    mid_lse="*fp32")  # fmt: skip
    constants = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=head_dim_pad(head_dim), BLOCK_SIZE=16, BLOCK_N=block_n, NUM_SPLITS=4,
        BALANCED=False, S_PAD=1, HAS_WINDOW=False, HAS_SOFTCAP=False, FP32=False, PDL=True,
        FP8=pool == "fp8", INT8=pool == "int8", K_GROUPS=int8_groups(head_dim, INT8_K_GROUP),
        K_GW=INT8_K_GROUP, prefix_lens=None, prefix_o=None, prefix_lse=None, PREFIX_SPLITS=0,
        TABLE_AHEAD=table_ahead,
    )  # fmt: skip
    if quantized:
        pointers.update(k_scale=SCALE_TYPES[pool], v_scale=SCALE_TYPES[pool])
    else:
        constants.update(k_scale=None, v_scale=None)
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    aligned = [name for name in fn.arg_names if name.startswith("stride")]
    return compile_offline(fn, pointers, constants, aligned, arch, options)


def loop_mix(sass: str) -> tuple[int, int, collections.Counter]:
    """(instructions, instructions of the longest backward-branch loop, its opcode counts)."""
    found = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in INSTRUCTION.finditer(sass)]
    loops = []
    for offset, opcode, operands in found:
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < offset:
            loops.append((int(target.group(1), 16), offset))
    if not loops:
        return len(found), 0, collections.Counter()
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = [opcode for offset, opcode, _ in found if start <= offset <= end]
    return len(found), len(body), collections.Counter(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="bf16,fp8,int8")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--config", default="", help="BLOCK_N,num_warps,num_stages")
    parser.add_argument("--maxnreg", type=int, default=None, help="0: the compiler's choice")
    parser.add_argument("--table-ahead", type=int, choices=[0, 1], default=None,
                        help="block ids a step ahead (default: the plan's)")  # fmt: skip
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    print(
        "| pool | config | maxnreg | ids ahead | registers | spill bytes | instructions | loop "
        "| top opcodes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for pool in args.pools.split(","):
        plan = default_plan(pool, args.head_dim, args.group)
        config = tuple(int(x) for x in args.config.split(",")) if args.config else plan[:3]
        maxnreg = plan.max_registers if args.maxnreg is None else args.maxnreg
        ahead = plan.table_ahead if args.table_ahead is None else bool(args.table_ahead)
        kernel = compile_decode(pool, args.head_dim, args.group, config, maxnreg, args.arch, ahead)
        used = resources(kernel)
        total, loop, opcodes = loop_mix(cuobjdump(kernel, "-sass"))
        top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.top))
        print(
            f"| {pool} | {config} | {maxnreg} | {ahead} | {used['registers']} | {used['local']} | "
            f"{total} | {loop} | {top} |"
        )


if __name__ == "__main__":
    main()
