"""GPU tests (``pytest -m gpu``) of the extend kernel with its block ids loaded a step ahead
(``TABLE_AHEAD``), at the stage counts that make the look-ahead a second K/V buffer (three
and four), and of the "tiles-ahead" routes through the launcher, in bf16 at real shapes,
each row against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOLERANCE, make_paged_kv, row_errors

from nanoserve.kernels import paged_extend_attention, paged_extend_attention_ref, triton_extend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16 = torch.bfloat16


@pytest.fixture
def table_ahead(monkeypatch):
    monkeypatch.setattr(triton_extend, "TABLE_AHEAD", True)


def _check_rows(out, ref, dtype):
    err = row_errors(out, ref)
    token, head = divmod(int(err.argmax()), err.shape[1])
    assert err.max() < 5 * TOLERANCE[dtype], f"token {token}, head {head}: {err.max():.2e}"


@pytest.mark.parametrize(
    "config",
    [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3, 128), (128, 64, 8, 3), (64, 64, 4, 4)],
    ids=str,
)
@pytest.mark.parametrize("window", [None, 700], ids=["causal", "window"])
def test_extend_with_table_ahead(config, window, table_ahead, poison_outputs):
    """A ragged prefill with a chunk over history (Qwen2-7B heads), every row checked."""
    history, new = [0, 3000, 17, 0], [777, 512, 1, 129]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, bt, sl = make_paged_kv(lens, 4, 128, 16, BF16, device="cuda")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu[-1]), 28, 128, device="cuda").to(BF16)
    ref = paged_extend_attention_ref(
        q.double(), kc.double(), vc.double(), bt, sl, cu, sliding_window=window
    )
    out = triton_extend.paged_extend_attention_triton(
        q, kc, vc, bt, sl, cu, scale=128**-0.5, sliding_window=window, softcap=None,
        config=config,
    )  # fmt: skip
    _check_rows(out, ref, BF16)


@pytest.mark.parametrize(
    ("hq", "hkv", "dim", "history", "new", "window"),
    [(28, 4, 128, [3000], [512], None), (32, 8, 128, [6000, 1500], [256, 255], None),
     (32, 8, 128, [0], [400], None), (32, 8, 128, [0, 0], [4096, 4000], 2048),
     (8, 4, 256, [3000], [512], None), (16, 8, 256, [5000], [256], None)],
    ids=["chunk-qwen", "chunks-llama", "short-prefill", "window-2x4k", "d256-chunk",
         "d256-chunk-16-heads"],
)  # fmt: skip
def test_tiles_ahead_routes_through_the_launcher(hq, hkv, dim, history, new, window,
                                                 poison_outputs):  # fmt: skip
    """Calls whose route_key takes a "tiles-ahead" route (chunks over history, a windowed
    prefill over a full grid), launched as an adapter does, every row checked."""
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, bt, sl = make_paged_kv(lens, hkv, dim, 16, BF16, device="cuda")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu[-1]), hq, dim, device="cuda").to(BF16)
    key = triton_extend.route_key(q, len(new), window, None, max_query_len=max(new))
    assert triton_extend.extend_route(key)[0] == "tiles-ahead", key
    ref = paged_extend_attention_ref(
        q.double(), kc.double(), vc.double(), bt, sl, cu, sliding_window=window
    )
    out = paged_extend_attention(
        q, kc, vc, bt, sl, cu, sliding_window=window, max_query_len=max(new)
    )
    _check_rows(out, ref, BF16)
