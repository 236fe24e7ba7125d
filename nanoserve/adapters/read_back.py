"""What the decode loop's host learns from the device, a few steps late and without waiting.

Each step copies the batch rows' "unfinished" flags (and, for a streamer, their tokens) into
pinned host memory and records an event; ``poll`` reads a step exactly ``READ_BACK_LAG``
steps after it was issued (on CUDA waiting on its event, which the device passed long ago:
the graph runner keeps the host at most a step or two ahead). Always that lag, never
"whatever has arrived": when the loop stops, how many steps it issued past the stop and
when rows leave the batch then depend on the tokens alone, not on timing, so tensor-
parallel ranks issue the same steps, a seed's global RNG state after the call is the same
run to run, and the CPU tests cut the same extra steps a GPU run does.
"""

from __future__ import annotations

from collections import deque

import torch

READ_BACK_LAG = 3  # decode steps issued after a step before the host reads it


class InvalidDraw(Exception):
    """A sampled step's distribution held NaN (where stock's ``torch.multinomial`` raises);
    ``length``: the sequence length that step made."""

    def __init__(self, length: int):
        super().__init__(length)
        self.length = length


class ReadBack:
    """Lagged read-back of one decode loop over ``rows`` rows (the call's full batch)."""

    def __init__(self, device: torch.device, rows: int, streamer, pad_value: int, has_eos: bool):
        self.streamer, self.pad_value, self.has_eos = streamer, pad_value, has_eos
        self.cuda = device.type == "cuda"
        slots = READ_BACK_LAG + 2
        self.unfinished = torch.zeros(
            slots, rows, dtype=torch.bool, device="cpu", pin_memory=self.cuda
        )
        self.tokens = torch.zeros(slots, rows, dtype=torch.long, device="cpu", pin_memory=self.cuda)
        self.invalid = torch.zeros(slots, dtype=torch.bool, device="cpu", pin_memory=self.cuda)
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]
        # (length, slot, batch rows, whether ``invalid`` holds the step's flag)
        self.pending: deque[tuple[int, int, list[int], bool]] = deque()
        self.next_slot = 0
        self.finished: set[int] = set()  # original rows known to have finished
        # the sequence length of the step whose tokens the streamer's put raised on, if any
        self.put_raised_at: int | None = None

    def push(self, length: int, unfinished, tokens, batch_rows: list[int], invalid=None) -> None:
        """The step that made the sequences ``length`` long: its ``unfinished`` [b] and
        ``tokens`` [b] of the batch rows ``batch_rows`` (original row of each), and for a
        sampled step ``invalid`` (bool []: its distribution held NaN)."""
        if not (self.has_eos or self.streamer is not None or invalid is not None):
            return
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % len(self.events)
        width = len(batch_rows)
        if self.has_eos:
            self.unfinished[slot, :width].copy_(unfinished, non_blocking=True)
        if self.streamer is not None:
            self.tokens[slot, :width].copy_(tokens, non_blocking=True)
        if invalid is not None:
            self.invalid[slot].copy_(invalid, non_blocking=True)
        if self.cuda:
            self.events[slot].record()
        self.pending.append((length, slot, batch_rows, invalid is not None))

    def poll(self, drain: bool = False) -> int | None:
        """The sequence length at which every row had finished, once read back; else None.
        Feeds the streamer each step read (every row: the rows that left get the pad) and
        adds the rows read as finished to ``finished``. ``drain`` reads every pending step.
        Raises ``InvalidDraw`` for a step read whose distribution held NaN, and what the
        streamer's put raises (``put_raised_at`` then says for which step)."""
        while self.pending:
            length, slot, batch_rows, checked = self.pending[0]
            event = self.events[slot]
            if not drain and len(self.pending) <= READ_BACK_LAG:
                return None
            if event is not None:
                event.synchronize()
            self.pending.popleft()
            if checked and bool(self.invalid[slot]):
                self.pending.clear()
                raise InvalidDraw(length)
            width = len(batch_rows)
            if self.streamer is not None:
                tokens = torch.full(
                    (self.tokens.shape[1],), self.pad_value, dtype=torch.long, device="cpu"
                )
                tokens[batch_rows] = self.tokens[slot, :width]
                try:
                    self.streamer.put(tokens)
                except BaseException:
                    self.pending.clear()
                    self.put_raised_at = length
                    raise
            if self.has_eos:
                flags = self.unfinished[slot, :width].tolist()
                self.finished.update(row for row, f in zip(batch_rows, flags, strict=True) if not f)
                if len(self.finished) == self.unfinished.shape[1]:
                    self.pending.clear()
                    return length
        return None
