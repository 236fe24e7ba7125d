"""Shared-prefix (cascade) decode plans: which decode rows read the same leading blocks.

Rows whose block tables begin with the same block ids hold the same K/V there (one physical
block per id). Decode attention can then read those blocks once for all such rows: a prefix
pass attends every member row's query to the shared blocks together (their keys read once,
the queries a matrix), and the decode kernel reads each row only from the first block after
its shared prefix, folding the prefix's partial result into its own (the split merge's
log-sum-exp arithmetic). The result is the same attention; only the order of the sums
differs.

A plan is two int32 tensors (host numpy here, device tensors at launch):
- ``prefix_lens`` [S]: the tokens of each row that the prefix pass covers (whole blocks, 0 for
  a row outside every group);
- ``tiles`` [T, TILE_ROWS]: the member rows of each prefix tile, -1 past a tile's last member;
  every row of a tile has the same shared blocks and ``prefix_lens``, and every row with a
  nonzero ``prefix_lens`` is in exactly one tile.

Pure host code (numpy): the planner knows nothing of models or of the cache's allocator.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from nanoserve.kernels.dispatch import sm_count

# Rows per prefix tile; the kernel packs a tile's rows times their query heads of one KV head
# into the rows of one matrix (in sub-tiles of at most 64 such rows).
TILE_ROWS = 16
# Tiles a plan may use beyond one per TILE_ROWS rows (each group's last tile is partial), so
# that a CUDA graph can hold a fixed tile buffer for a bucket of rows.
EXTRA_TILES = 4
# A shared-prefix plan is taken with at least this many (row, KV head) programs per SM: a
# grid that fills the GPU without splits. Fewer rows split each row instead, and there the
# prefix pass's launch, in sequence before the rows', cost more than the reads it saved (see
# benchmarks/RESULTS.md).
SHARED_PREFIX_PROGRAMS_PER_SM = 2


class SharedPrefixPlan(NamedTuple):
    """``prefix_lens`` int32 [S] and ``tiles`` int32 [T, TILE_ROWS] (see the module's text)."""

    prefix_lens: torch.Tensor
    tiles: torch.Tensor


def takes_shared_prefix(
    num_seqs: int, num_kv_heads: int, sliding_window: int | None, device: torch.device
) -> bool:
    """Whether a launch with a shared-prefix plan runs the prefix pass (from shapes only, for
    pools of any dtype): no sliding window, and at least SHARED_PREFIX_PROGRAMS_PER_SM
    (row, KV head) programs per SM; otherwise every row is read whole."""
    return (
        sliding_window is None
        and num_seqs * num_kv_heads >= SHARED_PREFIX_PROGRAMS_PER_SM * sm_count(device)
    )


def tile_capacity(num_rows: int) -> int:
    """The most prefix tiles a plan over ``num_rows`` rows uses (a fixed buffer's size)."""
    return -(-num_rows // TILE_ROWS) + EXTRA_TILES


def _groups(rows: np.ndarray, members: np.ndarray, usable: np.ndarray):
    """[(members, prefix blocks)] for rows ``members`` that agree on their first block:
    either one group over their common prefix, or subgroups that agree further, whichever
    saves more block reads ((members - 1) x prefix, summed), decided at every level of the
    tree of ever longer common prefixes. Walked with a stack, not recursion: rows whose
    prompts each extend the one before nest as deep as there are rows."""
    nodes = []  # per group of rows: [its whole group (or none), reads it saves, children]
    todo = [(members, 0, -1)]  # (rows, leading blocks they are known to share, parent)
    while todo:
        members, known, parent = todo.pop()
        if members.size < 2:
            continue
        most = int(usable[members].min())
        lead = rows[members[0], known:most]
        same = (rows[members, known:most] == lead).all(axis=0)
        common = most if same.all() else known + int(np.argmin(same))
        whole = [(members, common)] if common > 0 else []
        leaf = common >= int(usable[members].max())
        nodes.append([whole, (members.size - 1) * common, None if leaf else []])
        if parent >= 0:
            nodes[parent][2].append(len(nodes) - 1)
        if leaf:
            continue
        # rows still holding shared-candidate blocks past the common prefix, split by the next
        # id (pushed in reverse so that children are listed in the ids' order)
        deeper = members[usable[members] > common]
        ids = rows[deeper, common]
        for block in np.unique(ids)[::-1]:
            todo.append((deeper[ids == block], common + 1, len(nodes) - 1))
    chosen = [[] for _ in nodes]
    for index in range(len(nodes) - 1, -1, -1):  # children come after their parent
        whole, saved_whole, children = nodes[index]
        if children is None:
            chosen[index] = whole
            continue
        parts = [group for child in children for group in chosen[child]]
        saved_parts = sum((m.size - 1) * p for m, p in parts)
        chosen[index] = parts if saved_parts > saved_whole else whole
    return chosen[0] if nodes else []


def plan_shared_prefix(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    max_tiles: int | None = None,
) -> SharedPrefixPlan | None:
    """The plan for one decode step, or None when no two rows share a block.

    ``block_tables`` int32 [S, W] (host), ``seq_lens`` int32 [S]: each row's tokens, its
    newest included. Only whole blocks before each row's newest token's block are shared, so
    a block a row still writes is never in a prefix. Groups that save the most reads take
    tiles first; at most ``max_tiles`` (default ``tile_capacity(S)``) are used, and rows of a
    group that finds no room read their whole table as before.
    """
    block_tables = np.asarray(block_tables)
    seq_lens = np.asarray(seq_lens)
    num_rows = block_tables.shape[0]
    if num_rows < 2:
        return None
    max_tiles = tile_capacity(num_rows) if max_tiles is None else max_tiles
    usable = np.maximum(seq_lens.astype(np.int64) - 1, 0) // block_size
    usable = np.minimum(usable, block_tables.shape[1])
    candidates = np.flatnonzero(usable > 0)
    if candidates.size < 2:
        return None
    groups = []
    first = block_tables[candidates, 0]
    for block in np.unique(first):
        groups += _groups(block_tables, candidates[first == block], usable)
    if not groups:
        return None
    groups.sort(key=lambda g: -(g[0].size - 1) * g[1])
    prefix_lens = np.zeros(num_rows, np.int32)
    tiles = []
    for members, blocks in groups:
        needed = -(-members.size // TILE_ROWS)
        if len(tiles) + needed > max_tiles:
            continue
        prefix_lens[members] = blocks * block_size
        for start in range(0, members.size, TILE_ROWS):
            tile = np.full(TILE_ROWS, -1, np.int32)
            chunk = members[start : start + TILE_ROWS]
            tile[: chunk.size] = chunk
            tiles.append(tile)
    if not tiles:
        return None
    return SharedPrefixPlan(torch.from_numpy(prefix_lens), torch.from_numpy(np.stack(tiles)))


def check_shared_prefix(
    plan: SharedPrefixPlan, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> None:
    """ValueError naming ``shared_prefix`` unless ``plan`` holds for these tables: a plan that
    put rows of different prefixes in one tile would attend one row to another's keys."""
    lens, tiles = plan.prefix_lens, plan.tiles
    num_rows = block_tables.shape[0]
    if not isinstance(lens, torch.Tensor) or not isinstance(tiles, torch.Tensor):
        raise ValueError("shared_prefix: expected (prefix_lens, tiles) tensors")
    if lens.dtype != torch.int32 or lens.shape != (num_rows,):
        raise ValueError(
            f"shared_prefix: prefix_lens must be int32 [{num_rows}], got {lens.dtype} "
            f"{tuple(lens.shape)}"
        )
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != TILE_ROWS:
        raise ValueError(
            f"shared_prefix: tiles must be int32 [T, {TILE_ROWS}], got {tiles.dtype} "
            f"{tuple(tiles.shape)}"
        )
    for name, t in (("prefix_lens", lens), ("tiles", tiles)):
        if t.device != block_tables.device:
            raise ValueError(f"shared_prefix: {name} on {t.device}, block_tables on "
                             f"{block_tables.device}")  # fmt: skip
    lens, tiles = lens.cpu().numpy(), tiles.cpu().numpy()
    tables, seq = block_tables.cpu().numpy(), seq_lens.cpu().numpy()
    if (lens < 0).any() or (lens % block_size).any():
        raise ValueError("shared_prefix: prefix_lens must be whole blocks, >= 0")
    if (lens > np.maximum(seq - 1, 0)).any() or (lens > tables.shape[1] * block_size).any():
        raise ValueError("shared_prefix: a prefix reaches a row's newest token or its table's end")
    if ((tiles < -1) | (tiles >= num_rows)).any():
        raise ValueError(f"shared_prefix: tile rows must be -1 or in [0, {num_rows})")
    seen = np.zeros(num_rows, np.int64)
    for tile in tiles:
        members = tile[tile >= 0]
        np.add.at(seen, members, 1)
        if members.size == 0:
            continue
        if tile[0] < 0:
            raise ValueError("shared_prefix: a tile's first slot must hold a row")
        blocks = lens[members[0]] // block_size
        if (lens[members] != lens[members[0]]).any() or (
            tables[members, :blocks] != tables[members[0], :blocks]
        ).any():
            raise ValueError("shared_prefix: a tile holds rows of different prefixes")
    if ((lens > 0) != (seen == 1)).any() or (seen > 1).any():
        raise ValueError(
            "shared_prefix: every row with a prefix must be in exactly one tile, and no other"
        )
