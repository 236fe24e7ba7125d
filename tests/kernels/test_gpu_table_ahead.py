"""GPU tests (``pytest -m gpu``) of the decode and extend kernels with their block ids loaded
a step ahead (``TABLE_AHEAD``), at the stage counts that make the look-ahead a second K/V
buffer (three and four), in bf16 at real shapes, each row against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOLERANCE, check_decode_planted, make_paged_kv, row_errors

from nanoserve.kernels import paged_extend_attention_ref, triton_decode, triton_extend
from nanoserve.kernels.triton_decode import paged_decode_attention_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16 = torch.bfloat16


@pytest.fixture
def table_ahead(monkeypatch):
    monkeypatch.setattr(triton_decode, "TABLE_AHEAD", True)
    monkeypatch.setattr(triton_extend, "TABLE_AHEAD", True)


def _check_rows(out, ref, dtype):
    err = row_errors(out, ref)
    token, head = divmod(int(err.argmax()), err.shape[1])
    assert err.max() < 5 * TOLERANCE[dtype], f"token {token}, head {head}: {err.max():.2e}"


@pytest.mark.parametrize("stages", [None, 4], ids=["plan", "4-stages"])
@pytest.mark.parametrize(
    ("lens", "hkv", "group", "dim", "window"),
    [([32768], 4, 7, 128, None), ([5000, 1, 17, 16, 15, 3000], 8, 4, 128, 1000),
     ([4096] * 8, 8, 4, 64, None)],
    ids=["b1-32k-gqa7", "ragged-window", "8x4k-d64"],
)  # fmt: skip
def test_decode_with_table_ahead(lens, hkv, group, dim, window, stages, table_ahead,
                                 poison_outputs):  # fmt: skip
    kc, vc, bt, sl = make_paged_kv(lens, hkv, dim, 16, BF16, device="cuda")
    q = torch.randn(len(lens), hkv * group, dim, device="cuda").to(BF16)
    ref = triton_decode_ref(q, kc, vc, bt, sl, window)
    plan = triton_decode.decode_plan(q, kc, bt)
    config = None if stages is None else (plan.block_n, plan.num_warps, stages)
    out = paged_decode_attention_triton(
        q, kc, vc, bt, sl, scale=dim**-0.5, sliding_window=window, softcap=None, config=config
    )
    _check_rows(out, ref, BF16)


def triton_decode_ref(q, kc, vc, bt, sl, window):
    from nanoserve.kernels import paged_decode_attention_ref

    return paged_decode_attention_ref(
        q.double(), kc.double(), vc.double(), bt, sl, sliding_window=window
    )


def test_decode_planted_keys_with_table_ahead(table_ahead, poison_outputs):
    """A dominating key at the newest, the oldest and both sides of split boundaries of a
    32k row (the launcher's split count, three stages with the ids ahead)."""
    check_decode_planted(
        [32768], 8, 4, 128, 16, BF16, device="cuda", max_bounds=3, row_tol=TOLERANCE[BF16]
    )


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
