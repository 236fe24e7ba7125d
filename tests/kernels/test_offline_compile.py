"""The decode step's q/k/v launch compiled for sm_90 without a GPU (Triton's own ptxas), in
a subprocess outside the interpreter: CI has no GPU, and the interpreter runs programs the
compiler would refuse. Each variant must wait for the kernel ahead (``griddepcontrol.wait``)
before its first global store."""

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
from nanoserve.kernels import triton_linear

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
print(json.dumps(found))
"""


def test_the_rotary_and_kv_store_variants_compile_for_sm90():
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
