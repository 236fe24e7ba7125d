"""Content hash: a 64-bit digest of the exact bytes of many tensors, position by position.

Every tensor is read as raw words: 4 bytes wide when its address and byte count allow, else
2, else 1 (a word of 2 or 1 bytes is zero-extended to 32 bits). Word ``i`` of tensor number
``t`` (its place in the list) with value ``w`` gives, all arithmetic modulo 2**32,

    a = fmix32(w ^ (i * 0x9E3779B1) ^ fmix32(t * 0x85EBCA77 + 0x165667B1))
    b = fmix32(w ^ (i * 0xC2B2AE3D) ^ fmix32(t * 0x27D4EB2F + 0x61C88647))

(``fmix32``: MurmurHash3's finalizer, a bijection of 32-bit words), and the digest of each
word width is the sum of ``a`` and of ``b`` over all its words, modulo 2**32. A change of one
word always changes both sums (the finalizer is a bijection); moving values between places,
within a tensor or between tensors, changes them except by a 2**-64 chance (word indices
are taken modulo 2**32: in one tensor of over 16 GiB, words 2**32 apart share an index).
Sums of integers do not depend on their order: the digest is the same however the work is
split. Not a cryptographic hash: changes made to cancel can pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from nanoserve.kernels.dispatch import _interpreting, check_backend, triton_installed

MASK32 = 0xFFFFFFFF
# (index multiplier, tensor multiplier, tensor offset) of the two sums
LANES = ((0x9E3779B1, 0x85EBCA77, 0x165667B1), (0xC2B2AE3D, 0x27D4EB2F, 0x61C88647))
WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
# words of one work item of the kernel; the reference reads this many at a time too
CHUNK_WORDS = 1 << 16


class PendingDigest:
    """``content_digest``'s sums, queued on the tensors' device; ``result()`` reads them back."""

    def __init__(self, widths: tuple[int, ...], sums: torch.Tensor | None):
        self.widths, self.sums = widths, sums  # sums: int64 [widths, 2], not yet reduced

    def result(self) -> tuple:
        """The digest (``content_digest``'s value): one copy to the host, which waits for
        the sums."""
        if self.sums is None:
            return ()
        values = (self.sums & MASK32).cpu().tolist()
        return tuple((width, a, b) for width, (a, b) in zip(self.widths, values, strict=True))


def content_digest(tensors: Sequence[torch.Tensor], *, backend: str = "auto") -> tuple:
    """The digest of ``tensors`` (module docstring): a tuple of (word width, sum a, sum b)
    for each word width present, widths descending; () for no elements.

    ``tensors``: any dtypes and shapes, on one device (non-contiguous ones are read through a
    contiguous copy). ``backend``: "auto" (the Triton kernel for CUDA tensors when Triton is
    installed, else the reference), "triton" (on CPU needs TRITON_INTERPRET=1) or "torch".
    One read back to the host a call."""
    return launch_digest(tensors, backend=backend).result()


def launch_digest(tensors: Sequence[torch.Tensor], *, backend: str = "auto") -> PendingDigest:
    """``content_digest``'s work queued without waiting for it (same arguments, same checks):
    the host goes on while the device reads the bytes, until ``result()``."""
    return DigestPlan(tensors, backend=backend).launch()


class DigestPlan:
    """``content_digest``'s work over ``tensors`` laid out once (their words grouped by width
    and, for the kernel, its work items), to be launched again while the tensors lie where
    they did: ``fits(tensors)`` says whether they do, ``launch()`` queues the digest of the
    values they hold then. Laying out reads every tensor's metadata (a few microseconds a
    tensor, milliseconds a model); a check that the layout still holds, a fraction of that.
    Same arguments and checks as ``content_digest``. A plan that read some tensor through a
    copy (strided, complex or lazily negated) holds that copy's values, not the tensor's:
    ``reusable`` is then False and ``fits`` never says yes."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, backend: str = "auto"):
        check_backend(backend)
        groups, copied = _word_groups(tensors)
        self.widths = tuple(groups)
        self.reusable = not copied
        self.places = places(tensors) if self.reusable else None
        # a copy's words must outlive the launch that reads them (the kernel's launch
        # holds only the lowest-addressed words); views read tensors the caller holds
        self._copies = groups if copied else None
        self._launches: list = []
        if not groups:
            return
        device = next(iter(groups.values()))[0][1].device
        if _use_triton(backend, device):
            from nanoserve.kernels.triton_hash import prepare_group  # imports triton

            self._launches = [prepare_group(items) for items in groups.values()]
        else:
            self._launches = [functools.partial(group_sums_ref, items) for items in groups.values()]

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when ``tensors`` are where this plan reads: the same count, each at the same
        address with the same device, dtype and shape, contiguous, neither negated nor
        conjugated lazily (then ``launch()`` hashes their values now)."""
        return self.reusable and places(tensors) == self.places

    def launch(self) -> PendingDigest:
        """The digest of the planned tensors' values as they are now, queued on their
        device (``PendingDigest``; one read back to the host in its ``result()``)."""
        if not self._launches:
            return PendingDigest((), None)
        return PendingDigest(self.widths, torch.stack([launch() for launch in self._launches]))


def places(tensors: Sequence[torch.Tensor]) -> tuple:
    """What decides which memory ``DigestPlan`` reads for each of ``tensors``: address,
    device, dtype, shape, contiguity, lazy negation and conjugation."""
    return tuple(
        (t.data_ptr(), t.device, t.dtype, t.shape, t.is_contiguous(), t.is_neg(), t.is_conj())
        for t in tensors
    )


def word_groups(tensors: Sequence[torch.Tensor]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """{word width: [(tensor number, its words as a flat int32/int16/uint8 tensor)]}, widths
    descending; tensors without elements are left out. Raises ValueError naming ``tensors``
    for meta tensors or tensors on more than one device."""
    return _word_groups(tensors)[0]


def _word_groups(tensors: Sequence[torch.Tensor]) -> tuple[dict, bool]:
    """(``word_groups(tensors)``, whether any tensor's words are a copy of its values)."""
    groups: dict[int, list[tuple[int, torch.Tensor]]] = {4: [], 2: [], 1: []}
    devices = set()
    copied = False
    for number, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensors[{number}]: expected a torch.Tensor, got {type(tensor)}")
        if tensor.device.type == "meta":
            raise ValueError(f"tensors[{number}]: a meta tensor has no values to hash")
        devices.add(tensor.device)
        if tensor.numel() == 0:
            continue
        if tensor.is_contiguous() and not tensor.is_complex() and not tensor.is_neg():
            flat = tensor.detach().view(-1)  # (the common case, in fewer tensor operations)
        else:
            flat = tensor.detach().reshape(-1).resolve_neg()  # (a lazily negated view's values)
            if flat.is_complex():
                flat = torch.view_as_real(flat.resolve_conj()).reshape(-1)
            flat = flat.contiguous()
            copied = True
        nbytes, address = flat.numel() * flat.element_size(), flat.data_ptr()
        width = next(w for w in (4, 2, 1) if nbytes % w == 0 and address % w == 0)
        groups[width].append((number, flat.view(WORD_DTYPES[width])))
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"tensors: expected one device, got tensors on {names}")
    return {width: items for width, items in groups.items() if items}, copied


def group_sums_ref(items: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """int64 [2]: the two sums (not yet reduced modulo 2**32) over ``items`` (tensor number,
    words) of one width, in plain torch (int64 arithmetic, ``CHUNK_WORDS`` words at a time)."""
    total = torch.zeros(2, dtype=torch.int64, device=items[0][1].device)
    for number, words in items:
        keys = [
            _fmix32(torch.tensor((number * mul + add) & MASK32, device="cpu"))
            for _, mul, add in LANES
        ]
        word_mask = (1 << (8 * words.element_size())) - 1
        for start in range(0, words.numel(), CHUNK_WORDS):
            w = words[start : start + CHUNK_WORDS].to(torch.int64) & word_mask
            index = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
            for lane, ((index_mul, _, _), key) in enumerate(zip(LANES, keys, strict=True)):
                mixed = _fmix32(w ^ ((index * index_mul) & MASK32) ^ key.to(w.device))
                total[lane] += mixed.sum() & MASK32
    return total


def chunk_table(
    items: list[tuple[int, torch.Tensor]], chunk_words: int
) -> tuple[int, torch.Tensor]:
    """The kernel's work items over ``items`` (tensor number, words) of one width: (the base,
    the place in ``items`` of the words at the lowest address, so every offset is >= 0;
    int64 [4, C] rows: word offset from the base's address, words in the item, index of its
    first word in its tensor, tensor number)."""
    addresses = np.array([words.data_ptr() for _, words in items], dtype=np.int64)
    counts = np.array([words.numel() for _, words in items], dtype=np.int64)
    numbers = np.array([number for number, _ in items], dtype=np.int64)
    base = int(np.argmin(addresses))
    width = items[0][1].element_size()
    per_tensor = -(-counts // chunk_words)
    first = np.repeat(np.cumsum(per_tensor) - per_tensor, per_tensor)
    starts = (np.arange(per_tensor.sum()) - first) * chunk_words
    owner = np.repeat(np.arange(len(items)), per_tensor)
    offsets = (addresses[owner] - addresses[base]) // width + starts
    sizes = np.minimum(counts[owner] - starts, chunk_words)
    table = np.stack([offsets, sizes, starts, numbers[owner]])
    return base, torch.from_numpy(table)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 values in [0, 2**32) (products wrap in int64;
    their low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def kernel_runs_on(backend: str, device: torch.device) -> bool:
    """True when ``content_digest(..., backend=backend)`` of tensors on ``device`` runs the
    Triton kernel (never raises: False where it would refuse)."""
    if backend not in ("auto", "triton") or not triton_installed():
        return False
    return device.type == "cuda" or (backend == "triton" and _interpreting())


def _use_triton(backend: str, device: torch.device) -> bool:
    """``kernel_runs_on``, but "triton" where the kernel cannot run raises ValueError."""
    if backend == "triton" and not triton_installed():
        raise ValueError("backend: 'triton' needs the triton package, which is not installed")
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError("backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1")
    return kernel_runs_on(backend, device)
