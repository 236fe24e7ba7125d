"""Kernels of a decode step compiled for sm_90 without a GPU (Triton's own ptxas), in a
subprocess outside the interpreter: CI has no GPU, and the interpreter runs programs the
compiler would refuse (the q/k/v launch with its rotary and K/V-store epilogues, the gated
MLP's one cooperative launch). Each must wait for the kernel ahead
(``griddepcontrol.wait``) before its first global store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
sys.path[:0] = [{root!r}, {benchmarks!r}]
from extend_resources import compile_offline
from nanoserve.kernels import fused_mlp, triton_fused_mlp, triton_linear

names = ("x", "w0", "w1", "w2", "b0", "b1", "b2", "out", "partial", "rot_q", "rot_k", "cos",
         "sin", "key_pool", "value_pool")
found = {{}}
for store in (False, True):
    pointers = dict.fromkeys(names, "*bf16") | {{"slot_mapping": "*i64"}}
    constants = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT=1, GATED=False,
                     HAS_BIAS=False, EVEN_K=True, FP32=False, PDL=True, WEIGHTS_FIRST=True,
                     ROTARY=True, STORE_KV=store)
    options = dict(num_warps=4, num_stages=4, enable_fp_fusion=False, launch_pdl=True)
    kernel = compile_offline(triton_linear._linear_kernel, pointers, constants,
                             ("stride_x", "stride_out"), 90, options)
    ptx = kernel.asm["ptx"]
    found[str(store)] = [ptx.find("griddepcontrol.wait"), ptx.find("st.global"),
                         ptx.count("st.global")]
cfg = fused_mlp._config(8192, 2048, 132, True)  # (the 1B shape's one launch on 132 SMs)
pointers = dict.fromkeys(("x", "wg", "wu", "h", "wd", "out"), "*bf16")
pointers |= {{"state": "*i32", "partial": "*fp32"}}
constants = dict(BLOCK_M=16, UP_N=cfg.up_n, UP_K=cfg.up_k, DOWN_N=cfg.down_n,
                 DOWN_K=cfg.down_k, PHASES=3, EVEN_UP_K=True, EVEN_DOWN_K=True, FP32=False,
                 PDL=True, WEIGHTS_FIRST=True)
options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=True)
kernel = compile_offline(triton_fused_mlp._fused_mlp_kernel, pointers, constants,
                         ("stride_x", "stride_out"), 90, options)
ptx = kernel.asm["ptx"]
found["mlp"] = [ptx.find("griddepcontrol.wait"), ptx.find("st.global"), ptx.count("atom.")]
print(json.dumps(found))
"""


def test_decode_step_kernels_compile_for_sm90():
    """Planted: the pool store's flag read as ``int(store)`` (the interpreter ran it, the
    compile failed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = SCRIPT.format(root=str(ROOT), benchmarks=str(ROOT / "benchmarks"))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for wait, first_store, _ in found.values():
        assert 0 <= wait < first_store
    assert found["True"][2] > found["False"][2]  # the pool stores
    assert found["mlp"][2] > 0  # the grid barrier's and the K shares' atomics
