"""The token choice of nanoserve's decode loop, replayed as a CUDA graph.

After each decode step the loop turns the logits into the next tokens with a few device
ops: the float32 copy, the processors (sampling: the softmax and ``torch.multinomial``'s
random numbers), then ``pick_tokens``: the argmax (of the ratio to the random numbers when
sampling), the pad after EOS, the EOS test and the next positions in two launches. Each op
costs the host 10-30 µs to launch, so at small batches they cost about as
much host time as the GPU spends on the step. When the logits are a replayed decode graph's
output buffer (the same memory every step of its bucket) and the call returns no scores or
logits, ``TokenChoice`` captures those ops once per (buffer, rows, the processors' length
branch), the second time that key comes, and replays them; the running state (which rows
are unfinished, the positions, the repetition penalty's seen tokens) stays in fixed buffers
the graph updates in place. A sampled graph draws its random numbers as the eager ops do:
PyTorch's CUDA generator hands each replay the offset it holds then and moves it on by the
graph's draws, so a seed gives the same tokens either way. Elsewhere (the prefill's logits,
a step the model ran eagerly, returned scores or logits, the CPU) the same ops run eagerly
on the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nanoserve.adapters.decode_graphs import end_generator_capture
from nanoserve.adapters.device_sampling import StopRule, apply_steps
from nanoserve.kernels.token_pick import pick_tokens
from nanoserve.log import get_logger

_log = get_logger(__name__)


class Choice(NamedTuple):
    """One step's choice: ``logits`` float32 [B, V] (the step's logits copied),
    ``processed`` float32 [B, V] (after the processors: the scores), ``tokens`` int64 [B],
    ``invalid`` bool [] on the device (sampling: the distribution held NaN) or None."""

    logits: torch.Tensor
    processed: torch.Tensor
    tokens: torch.Tensor
    invalid: torch.Tensor | None


class TokenChoice:
    """Token choice for one loop (one generate call). ``steps``: ``processor_steps``;
    ``pad`` the pad token (an int64 device tensor) when EOS is checked, else None; ``capture``:
    replay graphs (on CUDA) where the logits allow (a lent output buffer); ``noise``: None
    for greedy, else the sampler's random numbers (``ActiveRows.noise``: softmax
    probabilities [B, V] -> (noise float32 [T, V], each row's noise row int64 [B] or None)),
    which must keep reading the same buffers until ``reset``."""

    def __init__(
        self, steps: list, rule: StopRule, pad, capture: bool,
        noise: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ):  # fmt: skip
        self.steps, self.rule, self.pad, self.capture = steps, rule, pad, capture
        self.noise = noise
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph, outputs)
        self.seen: set[tuple] = set()
        self.capturing: dict = {}  # the captures' memory pool and side stream
        self.failed: str | None = None  # a capture that failed: eager from then on
        self.replays = 0
        self.captures = 0

    def reset(self) -> None:
        """Drop the graphs and their memory pool (the batch was compacted: its rows' buffers,
        and the sampler's, are new, so no key of theirs comes back). The next capture takes a
        new pool: PyTorch refuses to capture into a pool whose graphs are gone while some of
        its memory is still held (the read-back holds the last steps' tokens)."""
        self.graphs.clear()
        self.seen.clear()
        self.capturing = {}

    def __call__(
        self, logits: torch.Tensor, unfinished: torch.Tensor, positions: torch.Tensor,
        length: int, lent: bool,
    ) -> Choice:  # fmt: skip
        """The ``Choice`` for ``logits`` [B, V] of the step whose positions [B, 1] were
        ``positions``: ``unfinished`` bool [B] and ``positions`` are updated in place (the
        next step's positions). ``lent``: the logits are a graph's output buffer, the same
        memory at each step of its bucket. A replayed choice returns its graph's buffers,
        which the next replay overwrites. Sampling: the caller keeps the random state from
        before this call, as the eager draw would meet it."""
        key = None
        if self.capture and lent and self.failed is None:
            key = (logits.data_ptr(), logits.shape, logits.stride(), logits.dtype,
                   unfinished.data_ptr(), positions.data_ptr(),
                   *(s.branch(length) for s in self.steps))  # fmt: skip
        held = self.graphs.get(key) if key is not None else None
        if held is not None:
            held[0].replay()
            self.replays += 1
            return held[1]
        if key is not None and key in self.seen:
            return self._capture(key, logits, unfinished, positions, length)
        if key is not None:
            self.seen.add(key)
        return self._choose(logits, unfinished, positions, length)

    def _choose(self, logits, unfinished, positions, length) -> Choice:
        logits = logits.to(copy=True, dtype=torch.float32)
        processed = apply_steps(self.steps, logits, length)
        scores, noise, rows = processed, None, None
        if self.noise is not None:
            scores = torch.nn.functional.softmax(processed, dim=-1)
            noise, rows = self.noise(scores)
        # finished rows get the pad token (as in stock), the EOS test sees it
        tokens, invalid = pick_tokens(
            scores, noise, rows, unfinished, self.pad, self.rule.eos, positions
        )
        for step in self.steps:
            step.observe(tokens, length)
        return Choice(logits, processed, tokens, invalid if noise is not None else None)

    def _capture(self, key, logits, unfinished, positions, length):
        try:
            args = (logits, unfinished, positions, length)
            graph, outputs = _record(self._choose, args, self.capturing)
        except Exception as error:  # (nothing ran: a capture records, it does not compute)
            self.failed = f"{type(error).__name__}: {error}"
            _log.info("token choice: capture failed, eager from here on (%s)", self.failed)
            if logits.is_cuda:  # a failed capture_end leaves the generator capturing
                end_generator_capture(logits.device)
            return self._choose(logits, unfinished, positions, length)
        self.graphs[key] = (graph, outputs)
        self.captures += 1
        graph.replay()
        self.replays += 1
        return outputs


def _record(run, args: tuple, kept: dict):
    """(a CUDA graph of ``run(*args)``'s device ops, run's outputs: the graph's buffers),
    captured into a memory pool on a side stream that ``kept`` holds (made at the first).

    Not ``torch.cuda.graph``, which synchronizes the device and empties the allocator's
    cache at each capture: a loop captures its choice anew each call, and an emptied cache
    sends the call's later allocations back to the driver."""
    if not kept:
        kept.update(pool=torch.cuda.graph_pool_handle(), side=torch.cuda.Stream())
    pool, side = kept["pool"], kept["side"]
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = run(*args)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, outputs
