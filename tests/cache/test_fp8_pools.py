"""FP8 pools in PagedKVCache: dtype, bytes, per-(layer, KV head) scales set once."""

from __future__ import annotations

import pytest
import torch

from nanoserve import PagedKVCache
from nanoserve.cache import paged_cache
from nanoserve.kernels import paged_decode_attention_ref
from nanoserve.kernels.quant import FP8_DTYPE, FP8_MAX, dequantize
from nanoserve.kernels.reference import attend_sequence, gather_history

HEADS, DIM = 3, 16


def _rows(n: int, magnitudes=(0.5, 2.0, 8.0)) -> torch.Tensor:
    """[n, HEADS, DIM] with a different magnitude per head."""
    return torch.randn(n, HEADS, DIM) * torch.tensor(magnitudes)[:, None]


def _write(cache: PagedKVCache, mask: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    cache.begin_step(mask, "cpu")
    for layer in range(cache.num_layers):
        cache.write(layer, key, value)


def test_first_write_calibrates_per_head_from_real_rows_only():
    """Scales = the real rows' per-head amax x headroom / 448; padding rows (slot -1) hold
    huge values that must not count; each layer calibrates from its own first write."""
    cache = PagedKVCache(2, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    mask = torch.tensor([[False, True, True, True, True, True]])
    key, value = _rows(6), _rows(6, (3.0, 1.0, 0.1))
    key[0], value[0] = 1e4, -1e4  # the padding column
    _write(cache, mask, key, value)
    for layer in range(2):
        assert cache.key_pools[layer].dtype == FP8_DTYPE
        k_scale, v_scale = cache.scales(layer)
        headroom = paged_cache.CALIBRATION_HEADROOM
        want_k = key[1:].abs().amax(dim=(0, 2)) * headroom / FP8_MAX
        want_v = value[1:].abs().amax(dim=(0, 2)) * headroom / FP8_MAX
        assert torch.allclose(k_scale, want_k) and torch.allclose(v_scale, want_v)
        assert k_scale.dtype == torch.float32 and k_scale.shape == (HEADS,)
        # what was stored reads back within e4m3's rounding
        table = torch.tensor(cache.tables[0].block_ids)
        back = dequantize(gather_history(cache.key_pools[layer], table, 5), k_scale, torch.float32)
        assert torch.allclose(back, key[1:], rtol=2**-4, atol=k_scale.max().item() * 2**-9)


def test_scales_never_change_after_the_first_write():
    """Later, larger rows saturate instead of moving the scale (which would misread the
    tokens stored), and the scale tensors stay the same objects (graphs read them)."""
    cache = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    _write(cache, torch.ones(1, 3, dtype=torch.bool), _rows(3), _rows(3))
    k_scale, v_scale = cache.scales(0)
    before = k_scale.clone()
    big = _rows(1) * 1000
    _write(cache, torch.ones(1, 1, dtype=torch.bool), big, big)
    assert cache.scales(0)[0] is k_scale and torch.equal(k_scale, before)
    stored = gather_history(cache.key_pools[0], torch.tensor(cache.tables[0].block_ids), 4)[3]
    assert (stored.float().abs() <= FP8_MAX).all() and (stored.float().abs() == FP8_MAX).any()


def test_reused_pools_keep_their_scales_and_fixed_scale():
    """A new cache over a finished cache's pool_lists keeps the scales (its cached prefixes
    were stored with them); kv_scale fixes every scale."""
    first = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    _write(first, torch.ones(1, 3, dtype=torch.bool), _rows(3), _rows(3))
    k_scale = first.scales(0)[0]
    later = PagedKVCache(
        1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE, pools=first.pool_lists,
        allocator=first.allocator,
    )  # fmt: skip
    _write(later, torch.ones(1, 2, dtype=torch.bool), _rows(2) * 10, _rows(2))
    assert later.scales(0)[0] is k_scale
    fixed = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE, kv_scale=0.25)
    _write(fixed, torch.ones(1, 2, dtype=torch.bool), _rows(2), _rows(2))
    assert all(torch.equal(s, torch.full((HEADS,), 0.25)) for s in fixed.scales(0))


def test_a_pool_given_without_its_scales_refuses_its_attached_prefix():
    """Two lists (keys, values) from a cache that published a prefix: the new cache cannot
    know the scales the prefix was stored at, so its first write refuses rather than
    calibrating anew (the prefix's keys then read back scaled wrong); given with its scales,
    the prefix reads back as stored. Planted: the check dropped: failed."""
    first = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    _write(first, torch.ones(1, 8, dtype=torch.bool), _rows(8) * 50, _rows(8))
    digests = [b"a" * 16, b"b" * 16]
    first.publish(0, digests)
    stored = first.key_pools[0].clone()
    first.reset()
    for lists in ((first.key_pools, first.value_pools), first.pool_lists):
        later = PagedKVCache(
            1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE,
            pools=tuple(list(x) for x in lists), allocator=first.allocator,
        )  # fmt: skip
        later.add_sequences(1)
        assert later.attach_prefix(0, digests) == 8
        if len(lists) == 2:
            with pytest.raises(ValueError, match="^key: layer 0's FP8 pool came without"):
                _write(later, torch.ones(1, 1, dtype=torch.bool), _rows(1), _rows(1))
            assert later.key_scales[0] is None
            assert torch.equal(later.key_pools[0].view(torch.uint8), stored.view(torch.uint8))
        else:
            _write(later, torch.ones(1, 1, dtype=torch.bool), _rows(1), _rows(1))
            assert later.scales(0)[0] is first.scales(0)[0]


def test_fp8_pools_count_one_byte_an_element_and_attend():
    """stats count 1 byte per FP8 element (half of bfloat16); attention over the cache with
    its scales matches attention over the float K/V within FP8's rounding."""
    caches = {}
    torch.manual_seed(0)  # e4m3's rounding of some draws lies near the 0.1 bound
    key, value = _rows(9), _rows(9)
    for name, dtype in (("bf16", None), ("fp8", FP8_DTYPE)):
        cache = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=dtype)
        k, v = (key, value) if dtype else (key.bfloat16(), value.bfloat16())
        _write(cache, torch.ones(1, 9, dtype=torch.bool), k, v)
        caches[name] = cache
    assert caches["bf16"].stats()["bytes_reserved"] == 2 * caches["fp8"].stats()["bytes_reserved"]
    cache = caches["fp8"]
    step = cache.step
    query = torch.randn(1, 2 * HEADS, DIM)
    k_scale, v_scale = cache.scales_for(cache.key_pools[0])
    out = paged_decode_attention_ref(
        query, cache.key_pools[0], cache.value_pools[0], step.block_tables, step.seq_lens,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    ref = attend_sequence(query, key, value, scale=DIM**-0.5, sliding_window=None, softcap=None)
    assert ((out - ref).norm() / ref.norm()).item() < 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kv_dtype=torch.float16), "^kv_dtype"),
        (dict(kv_dtype=FP8_DTYPE, kv_scale=0.0), "^kv_scale"),
        (dict(kv_dtype=FP8_DTYPE, kv_scale=float("nan")), "^kv_scale"),
        (dict(kv_scale=1.0), "^kv_scale"),
    ],
)
def test_bad_fp8_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedKVCache(1, num_blocks=4, block_size=4, **kwargs)


def test_a_fixed_scale_other_than_the_given_pools_scales_is_refused():
    """Pools given with their FP8 scales keep them (their K/V were stored at those): a
    ``kv_scale`` that differs is refused, naming it, before the kept allocator is released
    (the blocks the first cache holds stay held, its prefix stays cached); the same scale,
    or none, is taken. A grouped cache refuses before any group is made.

    Planted bug: the check dropped: kv_scale=2.0 was taken and silently unused (the scales
    stayed the calibrated ones); the check after the allocator's release: the blocks the
    first cache held were freed by the refused call."""
    from nanoserve.cache import BlockAllocator, GroupedKVCache

    first = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    _write(first, torch.ones(1, 8, dtype=torch.bool), _rows(8), _rows(8))
    digests = [b"a" * 16, b"b" * 16]
    first.publish(0, digests)
    lists = tuple(list(x) for x in first.pool_lists)
    with pytest.raises(ValueError, match="^kv_scale: the pools given come with FP8 scales"):
        PagedKVCache(1, 8, 4, pools=lists, allocator=first.allocator, kv_dtype=FP8_DTYPE,
                     kv_scale=2.0)  # fmt: skip
    assert first.allocator.num_free == 6  # the sequence's two blocks still held
    kept = PagedKVCache(1, 8, 4, pools=lists, allocator=first.allocator, kv_dtype=FP8_DTYPE)
    kept.add_sequences(1)
    assert kept.attach_prefix(0, digests) == 8  # the prefix survived the refusal
    fixed = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE, kv_scale=0.25)
    _write(fixed, torch.ones(1, 2, dtype=torch.bool), _rows(2), _rows(2))
    again = PagedKVCache(1, 8, 4, pools=fixed.pool_lists, kv_dtype=FP8_DTYPE, kv_scale=0.25)
    assert again.scales(0)[0] is fixed.scales(0)[0]
    groups = [([0], None), ([1], 64)]
    allocator = BlockAllocator(8)
    allocator.allocate(3)
    with pytest.raises(ValueError, match="^kv_scale"):
        GroupedKVCache(groups, num_blocks=[8, 8], block_size=4, kv_dtype=FP8_DTYPE,
                       kv_scale=0.5, pools=[None, fixed.pool_lists],
                       allocators=[allocator, None])  # fmt: skip
    assert allocator.num_free == 5  # group 0's kept allocator was not released


def test_a_refused_first_write_calibrates_nothing():
    """A first write into an FP8 cache whose rows cannot be written (a row count other than
    the step's slots, a value of another dtype) is refused naming the argument before its
    rows set the scales: the retry with the right rows calibrates from them, as a fresh cache
    does. A probe found the rejected rows' scales kept (the value scale 114.6 against
    0.0115, the retry stored at them, some values 0) and a raw RuntimeError. Planted,
    reverted: the row check removed: a raw RuntimeError from the calibration."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    key, value = _rows(4), _rows(4, (0.01, 0.02, 0.03))
    fresh = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    _write(fresh, mask, key, value)
    cache = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE)
    cache.begin_step(mask, "cpu")
    with pytest.raises(ValueError, match="^key: 3 rows"):
        cache.write(0, key[:3] * 1e4, value[:3] * 1e4)
    with pytest.raises(ValueError, match="^value: must match key"):
        cache.write(0, key * 1e4, value.double() * 1e4)
    assert cache.scales(0) == (None, None)
    cache.write(0, key, value)
    for got, want in zip(cache.scales(0), fresh.scales(0), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(cache.key_pools[0].view(torch.uint8), fresh.key_pools[0].view(torch.uint8))
