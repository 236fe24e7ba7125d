"""Fixed buffers of an extend step (new tokens in each row, cached ones or none before) for
a CUDA graph.

A graph of [rows, columns] tokens serves every step of at most that many rows and columns:
rows are left padded to the bucket's columns (a row's new tokens stay its last ones) and
rows past the batch are all padding. The extend kernel takes packed sequences, so each row
is two sequences of the padded layout: first its padding columns, a sequence of its own
that attends only to itself over block table row 0 (its outputs are never used; nothing
of it is stored: slot -1), then the row's new tokens over its own table. Every column is
then a token of some sequence, the query needs no packing, and every shape is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.cache import StepMetadata

MIN_COLUMNS = 16
MAX_TOKENS = 4096  # rows x columns of one extend graph
# Column buckets of the extend graphs: powers of two to 256, then steps of 128 (a prompt's
# padding to its bucket stays under 128 columns, small beside the eager forward's host
# time). A step of more columns runs eagerly, and so does one of at most MIN_COLUMNS, which
# the GQA-packed verify kernel serves eagerly.
COLUMN_BUCKETS = (32, 64, 128, 256, *range(384, MAX_TOKENS + 1, 128))


def fits_tables(columns: int, block_size: int, width: int) -> bool:
    """Whether a padding sequence of up to ``columns`` tokens reads only block-table entries
    of its own row and the next (``width`` entries each), never past the buffer's end."""
    return -(-columns // block_size) <= 2 * width


def column_bucket(columns: int) -> int | None:
    """The graph columns that serve ``columns`` new columns, or None (eager)."""
    if columns <= MIN_COLUMNS:
        return None
    return next((size for size in COLUMN_BUCKETS if columns <= size), None)


@dataclass
class StaticExtend:
    """The fixed buffers of one (rows, columns, table width) extend graph."""

    rows: int
    columns: int
    width: int
    device_buffer: torch.Tensor  # int32: ids | positions | slots | lens | cu | tables
    host_buffer: torch.Tensor  # pinned staging for slots | lens | cu | tables
    copied: torch.cuda.Event | None  # None off CUDA
    input_ids: torch.Tensor  # [rows, columns]
    position_ids: torch.Tensor  # [rows, columns]
    meta: StepMetadata

    @classmethod
    def allocate(cls, rows: int, columns: int, width: int, device: torch.device) -> StaticExtend:
        """Buffers for ``rows`` x ``columns`` tokens and ``width`` block-table columns."""
        tokens, seqs = rows * columns, 2 * rows
        size = 3 * tokens + seqs + seqs + 1 + seqs * width
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        on_cuda = device.type == "cuda"
        host = torch.zeros(size - 2 * tokens, dtype=torch.int32, device="cpu", pin_memory=on_cuda)
        ids, pos, slots = (buf[i * tokens : (i + 1) * tokens] for i in range(3))
        lens = buf[3 * tokens :][:seqs]
        cu = buf[3 * tokens + seqs :][: seqs + 1]
        tables = buf[3 * tokens + 2 * seqs + 1 :].view(seqs, width)
        meta = StepMetadata(
            slot_mapping=slots,
            token_index=torch.arange(tokens, device=device),
            block_tables=tables,
            seq_lens=lens,
            cu_seqlens_q=cu,
            all_single=False,
        )
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        return cls(
            rows, columns, width, buf, host, event,
            ids.view(rows, columns), pos.view(rows, columns), meta,
        )  # fmt: skip

    def load(self, host: StepMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Write one step's inputs (``host``: its metadata on the CPU, for ``input_ids``
        [n, q] left padded, q <= columns); the rest of the buffers becomes padding."""
        (n, q), rows, columns, width = input_ids.shape, self.rows, self.columns, self.width
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the staging buffer
        staging = self.host_buffer.numpy()
        tokens, seqs = rows * columns, 2 * rows
        slots = staging[:tokens].reshape(rows, columns)
        lens = staging[tokens:][:seqs]
        cu = staging[tokens + seqs :][: seqs + 1]
        tables = staging[tokens + 2 * seqs + 1 :].reshape(seqs, width)
        slots[:] = -1
        slots[:n, columns - q :] = host.slot_mapping.numpy().reshape(n, q)
        counts = host.cu_seqlens_q.numpy()
        new = counts[1 : n + 1] - counts[:n]
        sizes = [columns, 0] * rows  # (padding, new tokens) of each row
        sizes[0 : 2 * n : 2] = (columns - new).tolist()
        sizes[1 : 2 * n : 2] = new.tolist()
        cu[0] = 0
        np.cumsum(sizes, out=cu[1:])
        # A padding sequence sees only itself, through table row 0s: its table reads
        # (ceil(columns / block_size) entries) stay inside its row and the next, which
        # ``fits_tables`` asks of the step's columns before it takes this path.
        lens[0::2] = sizes[0::2]
        lens[1::2] = 0
        lens[1 : 2 * n : 2] = host.seq_lens.numpy()
        tables[:] = 0
        used = host.block_tables.shape[1]
        tables[1 : 2 * n : 2, :used] = host.block_tables.numpy()
        self.device_buffer[2 * tokens :].copy_(self.host_buffer, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        for static, given in ((self.input_ids, input_ids), (self.position_ids, position_ids)):
            static[:n, columns - q :].copy_(given)
            static[:n, : columns - q].zero_()
            static[n:].zero_()
