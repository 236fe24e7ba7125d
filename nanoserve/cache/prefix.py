"""Digests of full blocks of tokens, chained: a block's digest covers its tokens and every
token before them, so equal tokens after different prefixes never match."""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 16  # 128-bit BLAKE2b: a collision (another prefix's K/V) is not a practical risk


def block_digests(
    tokens, block_size: int, salt: bytes = b"", known: list[bytes] = ()
) -> list[bytes]:
    """One digest per full block of ``tokens`` (int token ids, oldest first): digest i covers
    ``salt`` and tokens ``[0, (i + 1) * block_size)``. ``salt`` carries whatever else changes
    the K/V (the weights, the dtype, the positions, a caller's isolation salt). ``known``: the
    digests of the leading blocks, already computed for another row with the same salt and
    the same leading tokens (the caller compares them); the chain resumes after them."""
    ids = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    digests = list(known[: len(ids) // block_size])
    parent = digests[-1] if digests else hashlib.blake2b(salt, digest_size=DIGEST_BYTES).digest()
    for start in range(len(digests) * block_size, len(ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(
            parent + ids[start : start + block_size].tobytes(), digest_size=DIGEST_BYTES
        ).digest()
        digests.append(parent)
    return digests
