"""Registers, spills and shared memory of the extend kernel per tile config, compiled for an
NVIDIA architecture without a GPU (Triton's own ptxas and cuobjdump), so that configs can be
sized before device time is spent: how many programs of a config fit on one SM decides more
than its tile shape (see benchmarks/RESULTS.md, 2026-12-04).

The installed Triton compiles: its code generation may differ from the device's version
(the H200 has triton 3.6; ``pip install triton==3.6.0`` into a separate environment matches
it). Usage:
    python benchmarks/extend_resources.py [--configs 64,64,4,2;128,64,8,2,128]
        [--head-dims 64,128,256] [--arch 90] [--window] [--softcap] [--table-ahead]
Prints one row per (head dim, config): registers a thread, local memory (spills), shared
memory, and programs per SM by registers and by shared memory (H100/H200: 64K registers,
227 KiB of shared memory a block may use, 228 KiB an SM).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanoserve.kernels import triton_extend  # noqa: E402

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
POINTERS = dict(
    query="*bf16", key_cache="*bf16", value_cache="*bf16", block_tables="*i32",
    seq_lens="*i32", cu_seqlens_q="*i32", out="*bf16",
)  # fmt: skip
FLOATS = ("scale", "softcap")
# arguments that are multiples of 16 at every real shape (Triton's divisibility hint)
ALIGNED = ("stride_qt", "stride_qh", "stride_cb", "stride_ct", "stride_ch", "stride_bt",
           "stride_ot", "stride_oh")  # fmt: skip


def compile_extend(config: tuple[int, ...], head_dim: int, arch: int, window: bool,
                   softcap: bool, table_ahead: bool = False):  # fmt: skip
    """The compiled ``_extend_kernel`` for bf16 pools at ``config`` (BLOCK_M, BLOCK_N,
    warps, stages[, maxnreg]), 28 query / 4 KV heads, block size 16."""
    fn = triton_extend._extend_kernel
    block_m, block_n, warps, stages = config[:4]
    constants = dict(
        GROUP=7, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=16,
        BLOCK_M=block_m, BLOCK_N=block_n, SEARCH_STEPS=3, NUM_Q_HEADS=28,
        HEADS_INNER=head_dim > 128, HAS_WINDOW=window, HAS_SOFTCAP=softcap, FP32=False,
        FAST_TANH=softcap, WARP_SPEC=False, k_scale=None, v_scale=None, FP8=False,
        INT8=False, K_GROUPS=1, G_PAD=1, TABLE_AHEAD=table_ahead,
    )  # fmt: skip
    options = dict(num_warps=warps, num_stages=stages)
    if len(config) > 4:
        options["maxnreg"] = config[4]
    return compile_offline(fn, POINTERS, constants, ALIGNED, arch, options)


def compile_offline(fn, pointers: dict, constants: dict, aligned, arch: int, options: dict,
                    floats=FLOATS):  # fmt: skip
    """``fn`` compiled for sm_``arch`` without a GPU: ``pointers`` name -> pointer type,
    ``constants`` the constexprs, ``floats`` as fp32, every other argument i32; pointers and
    the ``aligned`` arguments carry Triton's divisibility-by-16 hint."""
    signature, hints = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        elif name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
        if name in pointers or name in aligned:
            hints[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constants, hints)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def cuobjdump(kernel, flag: str) -> str:
    """Triton's own cuobjdump run with ``flag`` over the kernel's cubin: its output."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def resources(kernel) -> dict[str, int]:
    """Registers, stack and local memory a thread (cuobjdump's resource usage; a stack frame
    holds what calls to device functions spill), shared memory."""
    usage = cuobjdump(kernel, "--dump-resource-usage")
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return dict(registers=registers, stack=stack, local=local, shared=kernel.metadata.shared)


def parse_configs(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in c.split(",")) for c in filter(None, text.split(";"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="", help="';'-separated; default: CUDA_CONFIGS")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--window", action="store_true", help="with a sliding window")
    parser.add_argument("--softcap", action="store_true", help="with a soft-cap")
    parser.add_argument("--table-ahead", action="store_true", help="TABLE_AHEAD on")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    print("| head dim | config | registers | spill bytes | shared KiB | programs/SM |")
    print("|---|---|---|---|---|---|")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        family = triton_extend.config_family(head_dim, torch.bfloat16)
        configs = parse_configs(args.configs) or triton_extend.CUDA_CONFIGS[family]
        for config in configs:
            kernel = compile_extend(
                config, head_dim, args.arch, args.window, args.softcap, args.table_ahead
            )
            r = resources(kernel)
            # registers are allocated 8 a thread at a time
            by_registers = REGISTERS_PER_SM // (-(-r["registers"] // 8) * 8 * 32 * config[2])
            by_shared = SHARED_PER_SM // max(r["shared"] + 1024, 1)
            print(
                f"| {head_dim} | {config} | {r['registers']} | {r['local']} | "
                f"{r['shared'] / 1024:.0f} | {min(by_registers, by_shared)} "
                f"(registers {by_registers}, shared {by_shared}) |"
            )


if __name__ == "__main__":
    main()
