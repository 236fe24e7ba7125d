"""GPU tests (``pytest -m gpu``) of the extend paths the shape classes take: the GQA-packed
split-KV kernel (speculative verify), head_dim 256 with soft-cap (tanh.approx and exact),
sliding windows, in bf16 at real shapes, a packed call captured in a CUDA graph, and turns
over a long history routed to the split packed kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOLERANCE, make_paged_kv, row_errors, spy_extend_runs, spy_packed

from nanoserve.kernels import paged_extend_attention, paged_extend_attention_ref, triton_extend
from nanoserve.kernels.triton_verify import paged_extend_attention_packed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16, FP16 = torch.bfloat16, torch.float16


def _inputs(history, new, hkv, group, dim, bs, dtype):
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, bt, sl = make_paged_kv(lens, hkv, dim, bs, dtype, device="cuda")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu[-1]), hkv * group, dim, device="cuda").to(dtype)
    return q, kc, vc, bt, sl, cu


def _check_rows(out, ref, dtype):
    err = row_errors(out, ref)
    token, head = divmod(int(err.argmax()), err.shape[1])
    assert err.max() < 5 * TOLERANCE[dtype], f"token {token}, head {head}: {err.max():.2e}"


# (history, new, hkv, group, dim, block_size, dtype, window, softcap)
VERIFY = {
    "qwen7b-32x5-over-4000": ([4000] * 32, [5] * 32, 4, 7, 128, 16, BF16, None, None),
    "llama8b-ragged-draft": ([4000, 17, 1, 2500], [8, 1, 16, 3], 8, 4, 128, 16, BF16, None, None),
    "gemma2-d256-softcap-window": ([3000, 40], [4, 2], 8, 2, 256, 16, BF16, 1024, 50.0),
    "d64-mha-fp16-window": ([700, 15, 16], [2, 1, 5], 4, 1, 64, 16, FP16, 100, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(VERIFY), ids=list(VERIFY))
def test_packed_real_shapes(case, poison_outputs):
    history, new, hkv, group, dim, bs, dtype, window, softcap = VERIFY[case]
    args = _inputs(history, new, hkv, group, dim, bs, dtype)
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args),
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    routed = paged_extend_attention(
        *args, sliding_window=window, softcap=softcap, max_query_len=max(new)
    )
    _check_rows(routed, ref, dtype)
    for splits in (1, 3, 16):
        out = paged_extend_attention_packed(
            *args, scale=dim**-0.5, sliding_window=window, softcap=softcap,
            max_query_len=max(new), num_splits=splits,
        )  # fmt: skip
        _check_rows(out, ref, dtype)


# (family, head dim): one head dim per 16-bit family, padded where the family pads
FAMILY_DIMS = {"16bit-d64": 48, "16bit-d128": 80, "16bit-d256": 256}
AUTOTUNE_CASES = [
    (family, config)
    for family, dim in FAMILY_DIMS.items()
    for config in triton_extend.CUDA_CONFIGS[family]
]


@pytest.mark.parametrize("window", [None, 100], ids=["causal", "window"])
@pytest.mark.parametrize(("family", "config"), AUTOTUNE_CASES, ids=str)
def test_every_autotune_config_is_exact(family, config, window, poison_outputs):
    """Each config autotune may pick (register-capped ones included) at a padded head dim of
    its family, on sequences of 1, BLOCK_M - 1, BLOCK_M + 1 and 300 new tokens over cached
    history: autotune times its configs, it does not check them.

    Planted bug: 128-row tiles ending one key early (``q_end`` one short for BLOCK_M 128)
    failed every 128-row config here and passed the others."""
    dim = FAMILY_DIMS[family]
    block_m = config[0]
    args = _inputs([0, 40, 17, 300], [1, block_m - 1, block_m + 1, 300], 2, 4, dim, 16, BF16)
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args), sliding_window=window
    )
    out = triton_extend.paged_extend_attention_triton(
        *args, scale=dim**-0.5, sliding_window=window, softcap=None, config=config
    )
    _check_rows(out, ref, BF16)


@pytest.mark.parametrize("fast_tanh", [True, False], ids=["tanh-approx", "exact-tanh"])
@pytest.mark.parametrize(
    "config", [None, (64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 64, 8, 2)], ids=str
)
def test_d256_softcap_prefill(config, fast_tanh, monkeypatch, poison_outputs):
    """Gemma-2 shapes (16 / 8 heads, head_dim 256, soft-cap 50): a ragged prefill with a
    chunk over history, in the tile configs the class benchmark tries."""
    monkeypatch.setattr(triton_extend, "FAST_TANH", fast_tanh)
    args = _inputs([0, 300], [777, 129], 8, 2, 256, 16, BF16)
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args), softcap=50.0
    )
    out = triton_extend.paged_extend_attention_triton(
        *args, scale=256**-0.5, sliding_window=None, softcap=50.0, config=config
    )
    _check_rows(out, ref, BF16)


@pytest.mark.parametrize("window", [None, 200], ids=["causal", "window"])
def test_d256_prefill_autotuned(window, poison_outputs):
    """Gemma-3 shapes (8 / 4 heads, head_dim 256, no soft-cap): the tile-major grid under the
    family's autotuned configs, a ragged prefill with a chunk over history."""
    args = _inputs([0, 300, 5], [777, 129, 64], 4, 2, 256, 16, BF16)
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args), sliding_window=window
    )
    out = triton_extend.paged_extend_attention_triton(
        *args, scale=256**-0.5, sliding_window=window, softcap=None
    )
    _check_rows(out, ref, BF16)


def test_packed_cuda_graph(poison_outputs):
    """paged_extend_attention with check=False and a small max_query_len (the packed,
    split path with its scratch) captured once and replayed on new queries."""
    args = _inputs([1000, 37, 2000], [5, 5, 3], 4, 7, 128, 16, BF16)
    q, kc, vc, bt, sl, cu = args

    def call():
        return paged_extend_attention(q, kc, vc, bt, sl, cu, check=False, max_query_len=5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_extend_attention_ref(q.double(), kc.double(), vc.double(), bt, sl, cu)
    _check_rows(out, ref, BF16)


# (history, new, hkv, group, dim, block_size, dtype, window): turns over a cached prompt
TURNS = {
    "llama1b-4x64-over-2048": ([2048] * 4, [64] * 4, 8, 4, 64, 16, BF16, None),
    "llama1b-1x32-over-2048": ([2048], [32], 8, 4, 64, 16, BF16, None),
    "llama8b-1x64-over-8192": ([8192], [64], 8, 4, 128, 16, BF16, None),
    "ragged-d80-window": ([3000, 100, 5000], [64, 30, 17], 4, 8, 80, 16, FP16, 1000),
    "mha-d64-2x128": ([1500, 4000], [128, 100], 8, 1, 64, 32, BF16, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TURNS), ids=list(TURNS))
def test_turns_take_the_split_packed_kernel(case, monkeypatch, poison_outputs):
    """A turn's routed call (max_query_len up to TURN_MAX_QUERY_LEN over long history) runs
    the packed kernel with turn_plan's tile and count and matches the float64 reference, row
    by row."""
    from nanoserve.kernels import triton_verify

    history, new, hkv, group, dim, bs, dtype, window = TURNS[case]
    args = _inputs(history, new, hkv, group, dim, bs, dtype)
    plans = spy_packed(monkeypatch, "config", "num_splits")
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args), sliding_window=window
    )
    out = paged_extend_attention(*args, sliding_window=window, max_query_len=max(new))
    expected = triton_verify.turn_plan(args[0], args[1], args[3], max(new), window)
    assert expected[1] > 1 and plans == [expected]
    _check_rows(out, ref, dtype)


# (history, new, hkv, group, dim, block_size, dtype, window, softcap): routed chunks whose
# tiles leave most SMs idle (few heads), so their keys split into runs
SHORT_GRID_CHUNKS = {
    "gemma3-4b-d256-512-over-3000": ([3000], [512], 4, 2, 256, 16, BF16, None, None),
    "d256-softcap-256-over-5000": ([5000], [256], 8, 2, 256, 16, BF16, None, 50.0),
    "qwen-1.5b-d128-256-over-3000": ([3000], [256], 2, 6, 128, 16, BF16, None, None),
    "d128-fp16-two-chunks": ([2000, 900], [150, 40], 1, 8, 128, 32, FP16, None, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SHORT_GRID_CHUNKS), ids=list(SHORT_GRID_CHUNKS))
def test_short_grid_chunks_split_their_keys(case, monkeypatch, poison_outputs):
    """A routed chunk on a short grid launches extend_splits' runs (more than one) and
    matches the float64 reference row by row, eagerly and replayed from a CUDA graph."""
    history, new, hkv, group, dim, bs, dtype, window, softcap = SHORT_GRID_CHUNKS[case]
    args = _inputs(history, new, hkv, group, dim, bs, dtype)
    key = triton_extend.route_key(args[0], len(new), window, softcap, max(new))
    route = triton_extend.extend_route(key)
    assert route[0] in triton_extend.TILE_ROUTES, (key, route)
    expected = triton_extend.extend_splits(args[0], args[3], bs, route[1][0], window, max(new))
    assert expected > 1
    launched = spy_extend_runs(monkeypatch)
    opts = dict(sliding_window=window, softcap=softcap, max_query_len=max(new))
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args),
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    _check_rows(paged_extend_attention(*args, **opts), ref, dtype)
    assert launched == [expected]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_extend_attention(*args, **opts, check=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = paged_extend_attention(*args, **opts, check=False)
    graph.replay()
    torch.cuda.synchronize()
    _check_rows(replayed, ref, dtype)
