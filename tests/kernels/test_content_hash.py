"""Content hash: the Triton kernel (interpreter) gives the reference's sums, and the digest
moves with any change of a byte or of a value's place."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter

from nanoserve.kernels.content_hash import (
    MASK32,
    DigestPlan,
    content_digest,
    group_sums_ref,
    kernel_runs_on,
    launch_digest,
    word_groups,
)

BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def mixed_tensors(gen: torch.Generator) -> list[torch.Tensor]:
    """Tensors of every word width: dtypes, odd byte counts, unaligned and strided views."""
    storage = torch.randn(301, generator=gen)
    return [
        torch.randn(37, 5, generator=gen),  # float32: 4-byte words
        torch.randn(129, generator=gen).to(torch.bfloat16),
        torch.randn(3, generator=gen).to(torch.float16),  # 6 bytes: 2-byte words
        torch.randint(-(2**40), 2**40, (9,), generator=gen),  # int64
        torch.randint(0, 256, (7,), generator=gen, dtype=torch.uint8),  # 1-byte words
        torch.rand(5, generator=gen) > 0.5,  # bool
        storage.to(torch.bfloat16)[1:40],  # starts 2 bytes into its storage
        storage.view(torch.uint8)[3:20],  # starts 3 bytes in
        torch.randn(6, 4, generator=gen).t(),  # strided: read through a copy
        torch.randn(4, generator=gen, dtype=torch.complex64),
        torch._neg_view(torch.randn(5, generator=gen)),  # values negated lazily
        torch.tensor(float("nan")),  # 0-dim, NaN
        torch.tensor([float("inf"), float("-inf")]),
        torch.randn(0, 3, generator=gen),  # no elements: left out
    ]


@needs_interpreter
@pytest.mark.parametrize("chunk_words", [1, 7, 64, 100, 4096])
def test_kernel_sums_equal_the_reference(chunk_words):
    """Every word width, work items of every size around the tensors' lengths (one word,
    less than a tensor, several per tensor, more than any tensor). Planted: the tail mask
    dropped from the sums, or the tensor number left out of the kernel's key: failed."""
    from nanoserve.kernels.triton_hash import group_sums_triton

    gen = torch.Generator().manual_seed(chunk_words)
    tensors = mixed_tensors(gen) + [torch.randn(chunk_words + 1, generator=gen)]
    groups = word_groups(tensors)
    assert sorted(groups) == [1, 2, 4]
    for items in groups.values():
        ours = group_sums_triton(items, chunk_words=chunk_words) & MASK32
        assert torch.equal(ours, group_sums_ref(items) & MASK32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_launched_digest_holds_the_values_at_its_launch(backend):
    """``launch_digest`` queues the work and ``result()`` reads it later (prefix_salt sizes
    the pool in between): a write queued after the launch does not reach the digest, and the
    result is ``content_digest``'s. Planted: the sums computed in ``result()``, from the
    tensors as they are then: failed."""
    gen = torch.Generator().manual_seed(5)
    tensors = mixed_tensors(gen)
    before = content_digest(tensors, backend=backend)
    pending = launch_digest(tensors, backend=backend)
    tensors[0].add_(1.0)
    tensors[4].add_(1)
    assert pending.result() == before
    assert content_digest(tensors, backend=backend) != before
    assert launch_digest([], backend=backend).result() == ()


def contiguous_tensors(gen: torch.Generator) -> list[torch.Tensor]:
    """Tensors a plan reads in place (of every word width), among them a square matrix."""
    return [
        torch.randn(6, 6, generator=gen),
        torch.randn(129, generator=gen).to(torch.bfloat16),
        torch.randn(3, generator=gen).to(torch.float16),
        torch.randint(0, 256, (7,), generator=gen, dtype=torch.uint8),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_launched_again_hashes_the_values_then(backend):
    """A plan laid out once and launched after writes in place (same addresses) gives the
    digest of the new values, as a fresh ``content_digest`` does. Planted: the launch
    reading the values saved at lay-out: failed."""
    gen = torch.Generator().manual_seed(6)
    tensors = contiguous_tensors(gen)
    plan = DigestPlan(tensors, backend=backend)
    before = content_digest(tensors, backend=backend)
    assert plan.reusable and plan.fits(tensors)
    assert plan.launch().result() == before
    tensors[0].mul_(1.5)
    tensors[3].add_(1)
    assert plan.fits(tensors)
    after = plan.launch().result()
    assert after == content_digest(tensors, backend=backend) != before


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_fits_only_tensors_where_it_reads(backend):
    """``fits`` says no when a tensor moved, or lies at the same address as another view of
    the same bytes (transposed: the same address and shape; negated lazily), or the list
    changed; a plan that read a strided tensor through a copy is never reused. Planted:
    contiguity left out of what a plan compares: the transposed matrix fitted, and its
    launch gave the untransposed digest: failed."""
    gen = torch.Generator().manual_seed(7)
    tensors = contiguous_tensors(gen)
    plan = DigestPlan(tensors, backend=backend)
    square = tensors[0]
    before = content_digest(tensors, backend=backend)
    for changed, same_values in (
        ([square.clone(), *tensors[1:]], True),  # moved
        ([square.t(), *tensors[1:]], False),  # same address and shape, transposed
        ([torch._neg_view(square), *tensors[1:]], False),
        (tensors[:3], False),
    ):
        assert not plan.fits(changed)
        assert (content_digest(changed, backend=backend) == before) is same_values
    strided = DigestPlan([square.t(), *tensors[1:]], backend=backend)
    assert not strided.reusable and not strided.fits([square.t(), *tensors[1:]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_changed_byte_changes_the_digest(backend):
    """One bit flipped anywhere, in any tensor (the finalizer is a bijection: always seen),
    including a float's lowest mantissa bit and a NaN payload."""
    gen = torch.Generator().manual_seed(1)
    tensors = mixed_tensors(gen)
    before = content_digest(tensors, backend=backend)
    assert before == content_digest(tensors, backend=backend)  # deterministic
    for trial in range(12):
        number = int(torch.randint(0, len(tensors) - 1, (1,), generator=gen))
        raw = tensors[number].view(-1) if tensors[number].is_contiguous() else None
        if raw is None or raw.numel() == 0:
            continue
        byte_view = raw.view(torch.uint8) if raw.dtype != torch.bool else raw.view(torch.uint8)
        at = int(torch.randint(0, byte_view.numel(), (1,), generator=gen))
        bit = 1 << (trial % 8)
        byte_view[at] ^= bit
        assert content_digest(tensors, backend=backend) != before, (number, at, bit)
        byte_view[at] ^= bit
        assert content_digest(tensors, backend=backend) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_moved_values_change_the_digest(backend):
    """The same values at other places: rows swapped, columns swapped, a vector reversed,
    two tensors' contents exchanged, bytes exchanged within a word. Planted: the word index
    left out of the key (rows and columns passed unseen), the tensor number left out
    (exchanged tensors passed unseen): failed."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 5, generator=gen).to(torch.bfloat16)
    other = torch.randn(6, 5, generator=gen).to(torch.bfloat16)
    codes = torch.randint(0, 256, (8,), generator=gen, dtype=torch.uint8)
    cases = [
        lambda: weight.copy_(weight[[1, 0, 2, 3, 5, 4]].clone()),
        lambda: weight.copy_(weight[:, [0, 3, 2, 1, 4]].clone()),
        lambda: codes.copy_(codes.flip(0).clone()),
        lambda: (weight.copy_(other.clone()), other.copy_(saved[0])),
        lambda: codes.copy_(codes.view(4, 2).flip(1).reshape(-1).clone()),
    ]
    for change in cases:
        saved = [weight.clone(), other.clone(), codes.clone()]
        before = content_digest([weight, other, codes], backend=backend)
        change()
        assert content_digest([weight, other, codes], backend=backend) != before
        weight.copy_(saved[0]), other.copy_(saved[1]), codes.copy_(saved[2])


@needs_interpreter
def test_the_backends_agree():
    gen = torch.Generator().manual_seed(3)
    tensors = mixed_tensors(gen)
    assert content_digest(tensors, backend="triton") == content_digest(tensors, backend="torch")


def test_bad_tensors_are_named():
    with pytest.raises(ValueError, match=r"tensors\[1\]: a meta tensor"):
        content_digest([torch.ones(2), torch.ones(2, device="meta")])
    with pytest.raises(ValueError, match=r"tensors\[0\]: expected a torch.Tensor"):
        content_digest([[1.0]])
    values = torch.randn(6)
    assert content_digest([torch._neg_view(values)]) == content_digest([-values])
    with pytest.raises(ValueError, match="backend"):
        content_digest([torch.ones(2)], backend="cuda")
    assert content_digest([]) == ()
    assert not kernel_runs_on("torch", torch.device("cpu"))
