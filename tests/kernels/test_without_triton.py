"""``import nanoserve``, the cache and the torch references work where Triton is not installed;
asking for the Triton backend there says so (a ValueError naming triton, not a NameError).

Runs in a subprocess with ``sys.modules["triton"] = None``, which makes every ``import
triton`` fail as it would without the package. (Before the kernels imported Triton lazily,
``import nanoserve`` itself failed that way.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # any "import triton" now raises ImportError

    import torch
    import nanoserve
    from nanoserve import PagedKVCache
    from nanoserve.kernels import (
        paged_decode_attention, paged_decode_attention_ref,
        paged_extend_attention, paged_extend_attention_ref, slot_scatter,
    )

    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4)
    step = cache.begin_step(torch.tensor([[True] * 6, [False] * 3 + [True] * 3]), "cpu")
    key, value = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    key_pool, value_pool = cache.write(0, key, value)
    query = torch.randn(2, 4, 16)
    args = (query, key_pool, value_pool, step.block_tables, step.seq_lens)
    ref = paged_decode_attention_ref(*args)
    for backend in ("torch", "auto"):
        out = paged_decode_attention(*args, backend=backend)
        assert torch.equal(out, ref), backend
        extend_q = torch.randn(9, 4, 16)
        ext_args = (extend_q, *args[1:], step.cu_seqlens_q)
        ext = paged_extend_attention(*ext_args, backend=backend)
        assert torch.equal(ext, paged_extend_attention_ref(*ext_args)), backend
        k_pool, v_pool = torch.zeros_like(key_pool), torch.zeros_like(value_pool)
        slot_scatter(key, value, k_pool, v_pool, step.slot_mapping, backend=backend)
        assert torch.equal(k_pool, key_pool) and torch.equal(v_pool, value_pool), backend
    assert cache.seq_lens() == [6, 3]

    for name, call in [
        ("decode", lambda: paged_decode_attention(*args, backend="triton")),
        ("extend", lambda: paged_extend_attention(
            extend_q, *args[1:], step.cu_seqlens_q, backend="triton")),
        ("scatter", lambda: slot_scatter(key, value, k_pool, v_pool, step.slot_mapping,
                                         backend="triton")),
    ]:
        try:
            call()
        except ValueError as error:
            assert str(error).startswith("backend") and "triton" in str(error), (name, error)
        else:
            raise AssertionError(name + ": backend='triton' ran without triton")
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules
                   if sys.modules[m] is not None)
    print("OK")
    """
)


def test_nanoserve_works_without_triton():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # so 'triton' fails for the package alone
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr
