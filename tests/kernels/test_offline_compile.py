"""The kernels of a fused decode step compiled for sm_90 without a GPU (Triton's own
ptxas), in a subprocess outside the interpreter: CI has no GPU, and the interpreter runs
programs the compiler would refuse. Covered: the q/k/v launch with its rotary epilogue,
with and without the K/V store; the gated MLP's one cooperative launch; the residual add
with its RMSNorm; the rotary tables; decode attention in fixed splits and their merge; the
slot scatter (bf16, PDL on)."""

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
from nanoserve.kernels import (fused_mlp, triton_decode, triton_fused_mlp, triton_linear,
                               triton_rms_norm, triton_rotary, triton_scatter)

def compiled(fn, pointers, constants, options, floats=("scale", "softcap")):
    options = dict(num_warps=4, launch_pdl=True) | options
    kernel = compile_offline(fn, pointers, constants, (), 90, options, floats)
    ptx = kernel.asm["ptx"]
    return [ptx.find("griddepcontrol.wait"), ptx.find("st.global"), ptx.count("st.global"),
            ptx.count("atom.")]

bf16 = "*bf16"
found = {{}}
names = ("x", "w0", "w1", "w2", "b0", "b1", "b2", "out", "partial", "rot_q", "rot_k", "cos",
         "sin", "key_pool", "value_pool")
for store in (False, True):
    found[f"linear store={{store}}"] = compiled(
        triton_linear._linear_kernel, dict.fromkeys(names, bf16) | {{"slot_mapping": "*i64"}},
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT=1, GATED=False, HAS_BIAS=False,
             EVEN_K=True, FP32=False, PDL=True, WEIGHTS_FIRST=True, ROTARY=True,
             STORE_KV=store),
        dict(num_stages=4, enable_fp_fusion=False))
cfg = fused_mlp._config(8192, 2048, 132, True)  # (the 1B shape's one launch on 132 SMs)
found["mlp"] = compiled(
    triton_fused_mlp._fused_mlp_kernel,
    dict.fromkeys(("x", "wg", "wu", "h", "wd", "out"), bf16)
    | {{"state": "*i32", "partial": "*fp32"}},
    dict(BLOCK_M=16, UP_N=cfg.up_n, UP_K=cfg.up_k, DOWN_N=cfg.down_n, DOWN_K=cfg.down_k,
         PHASES=3, EVEN_UP_K=True, EVEN_DOWN_K=True, FP32=False, PDL=True, WEIGHTS_FIRST=True),
    dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
found["add_rms_norm"] = compiled(
    triton_rms_norm._rms_norm_kernel,
    dict.fromkeys(("x", "residual", "weight", "out", "total"), bf16),
    dict(BLOCK=2048, RESIDUAL=True, PDL=True), {{}}, floats=("eps",))
found["cos_sin"] = compiled(
    triton_rotary._cos_sin_kernel,
    {{"positions": "*i64", "inv_freq": "*fp32", "cos": bf16, "sin": bf16}},
    dict(BLOCK=32, ACCURATE=True, PDL=True), {{}}, floats=("scaling",))
found["decode"] = compiled(
    triton_decode._decode_kernel,
    dict.fromkeys(("query", "key_cache", "value_cache", "out"), bf16)
    | dict.fromkeys(("block_tables", "seq_lens"), "*i32")
    | dict.fromkeys(("mid_o", "mid_lse"), "*fp32"),
    dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_N=128,
         NUM_SPLITS=4, BALANCED=False, S_PAD=1, HAS_WINDOW=False, HAS_SOFTCAP=False,
         FP32=False, PDL=True, k_scale=None, v_scale=None, FP8=False, INT8=False, K_GROUPS=1,
         K_GW=16, prefix_lens=None, prefix_o=None, prefix_lse=None, PREFIX_SPLITS=0,
         TABLE_AHEAD=False),
    dict(num_stages=2))
found["reduce"] = compiled(
    triton_decode._reduce_kernel,
    {{"mid_o": "*fp32", "mid_lse": "*fp32", "out": bf16}},
    dict(HEAD_DIM=64, D_PAD=64, D_BLOCK=64, NUM_SPLITS=4, SPLITS_PAD=4, PDL=True), {{}})
found["scatter"] = compiled(
    triton_scatter._slot_scatter_kernel,
    dict.fromkeys(("key", "value", "key_cache", "value_cache"), bf16) | {{"slot_mapping": "*i64"}},
    dict(k_scale=None, v_scale=None, NUM_KV_HEADS=8, HEAD_DIM=64, BLOCK_T=1, BLOCK_H=8,
         BLOCK_D=64, FP8=False, PDL=True, INT8=False, K_GROUPS=1, K_GW=16), {{}})
print(json.dumps(found))
"""


def test_decode_step_kernels_compile_for_sm90():
    """Each waits for the kernel ahead before its first global store; the K/V store adds
    stores to the q/k/v launch; the MLP's grid barrier and the split merge's inputs are
    there. Planted: the pool store's flag read as ``int(store)`` (the interpreter ran it,
    the compile failed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = SCRIPT.format(root=str(ROOT), benchmarks=str(ROOT / "benchmarks"))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(found) == 8
    for name, (wait, first_store, stores, _) in found.items():
        assert 0 <= wait < first_store and stores > 0, name
    assert found["linear store=True"][2] > found["linear store=False"][2]  # the pool stores
    assert found["mlp"][3] > 0  # the grid barrier's and the K shares' atomics
