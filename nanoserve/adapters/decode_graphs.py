"""Decode steps of a patched model as replayed CUDA graphs.

A decode step (one new token in every row, on CUDA) runs as a CUDA graph: one graph per
batch bucket (1, 2, 4, ..., 128, then multiples of 128), block-table width, whether the
rows are of one length (the attention launch differs) and which layer group's steps carry a
shared-prefix plan (``plan_group_of``; none: rows read whole), captured on the first step
that needs it and replayed after, all graphs drawing on one memory pool.
What changes from step to step lives in fixed device buffers updated in place before the
replay: token ids, positions, slot mapping, block tables and lengths (one int32 buffer,
filled by one host-to-device copy; a slot mapping and block tables per layer group for a
``GroupedKVCache``; the plan's prefix lengths and tiles at its end). New blocks are
allocated on the host by ``begin_step`` before the replay, never inside it. Rows past the
batch pad the bucket: slot -1 (nothing is stored), length 1, and their logits are dropped.

Extend steps of more than 16 new columns and at most 4,096 tokens in all (a prompt's
prefill over a pool an earlier call made, later turns of a chat over a cached prompt, the
rows' own tokens after a shared prefix, prefill chunks) run as graphs too, one per (rows
bucket, columns bucket, table width), on the buffers of ``extend_static.py``, captured
the second time their bucket comes (the first runs on the same buffers without a graph).
A failed extend capture turns extend graphs off, not decode graphs. Longer prefills stay
eager.

Graphs point at the pools' and the weights' memory. A new cache (a new ``generate`` call)
keeps them when the step's ``signature`` (those addresses) is unchanged, as when it took over
the last call's pools; otherwise the graphs are dropped and captured anew.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.adapters.extend_static import StaticExtend, column_bucket
from nanoserve.cache import StepMetadata
from nanoserve.cache.paged_cache import grouped_metadata
from nanoserve.kernels.shared_prefix import TILE_ROWS, SharedPrefixPlan, tile_capacity
from nanoserve.log import get_logger

_log = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket_for(batch: int) -> int:
    """The graph batch size that serves ``batch`` rows."""
    for size in BUCKETS:
        if batch <= size:
            return size
    return -(-batch // BUCKETS[-1]) * BUCKETS[-1]


def plan_group_of(host: StepMetadata) -> int | None:
    """The layer group whose decode steps carry a shared-prefix plan (0 for a cache of one
    group), or None: no group's does, or several do (their plans, over different tables,
    would need buffers each; such steps read rows whole under a graph). A grouped cache's
    windowed groups never plan, so a model mixing sliding and global layers has one."""
    metas = host.group_metas or (host,)
    planned = [g for g, meta in enumerate(metas) if meta.shared_prefix is not None]
    return planned[0] if len(planned) == 1 else None


@dataclass
class StaticStep:
    """The fixed buffers of one bucket, as views of one int32 device buffer."""

    rows: int
    width: int
    device_buffer: torch.Tensor
    host_buffer: torch.Tensor  # pinned staging for the metadata part
    copied: torch.cuda.Event | None  # None off CUDA
    input_ids: torch.Tensor  # [rows, 1]
    position_ids: torch.Tensor  # [rows, 1]
    meta: StepMetadata
    plan_group: int | None  # the layer group whose plan the buffers hold (``allocate``)

    @classmethod
    def allocate(
        cls, rows: int, width: int, device: torch.device, layer_groups: tuple[int, ...] = (),
        equal_lengths: bool = False, plan_group: int | None = None,
    ) -> StaticStep:  # fmt: skip
        """Buffers for ``rows`` rows and ``width`` block-table columns; with
        ``layer_groups`` (each layer's group, as ``StepMetadata`` has them) a slot mapping
        and block tables for each group. ``equal_lengths``: the steps loaded into it have
        real rows all of one length (the padding rows past them do not count).
        ``plan_group``: the steps loaded come with a shared-prefix plan for that layer group
        (``plan_group_of``), held in buffers of ``tile_capacity(rows)`` tiles."""
        groups = max(layer_groups, default=0) + 1
        shared_prefix = plan_group is not None
        tiles = tile_capacity(rows) if shared_prefix else 0
        # layout: ids | positions | seq_lens | each group's slots | each group's block tables
        # | the plan's prefix lengths | its tiles
        metadata = rows * (3 + groups * (1 + width))
        size = metadata + (rows + tiles * TILE_ROWS if shared_prefix else 0)
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        on_cuda = device.type == "cuda"
        host = torch.zeros(size - 2 * rows, dtype=torch.int32, device="cpu", pin_memory=on_cuda)
        ids, pos, lens = (buf[i * rows : (i + 1) * rows] for i in range(3))
        tables_at = (3 + groups) * rows
        token_index = torch.arange(rows, device=device)
        cu_seqlens = torch.arange(rows + 1, dtype=torch.int32, device=device)
        plan = None
        if shared_prefix:
            plan = SharedPrefixPlan(
                buf[metadata : metadata + rows], buf[metadata + rows :].view(tiles, TILE_ROWS)
            )
        metas = tuple(
            StepMetadata(
                slot_mapping=buf[(3 + g) * rows : (4 + g) * rows],
                token_index=token_index,
                block_tables=buf[tables_at + g * rows * width :][: rows * width].view(rows, width),
                seq_lens=lens,
                cu_seqlens_q=cu_seqlens,
                all_single=True,
                equal_lengths=equal_lengths,
                shared_prefix=plan if g == plan_group else None,
            )
            for g in range(groups)
        )
        meta = grouped_metadata(metas, layer_groups) if layer_groups else metas[0]
        event = None
        if on_cuda:
            event = torch.cuda.Event()
            event.record()
        ids, pos = ids.view(rows, 1), pos.view(rows, 1)
        return cls(rows, width, buf, host, event, ids, pos, meta, plan_group)

    def load(self, host: StepMetadata, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Write one step's inputs; rows past the batch become padding."""
        n, rows, width = input_ids.shape[0], self.rows, self.width
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the staging buffer
        staging = self.host_buffer.numpy()  # numpy: a tenth of torch's per-op host cost
        lens = staging[:rows]
        lens[:n] = host.seq_lens.numpy()
        lens[n:] = 1
        metas = host.group_metas or (host,)
        if self.plan_group is not None:  # (the plan ends the layout)
            held = tile_capacity(rows)
            plan_at = staging.size - rows - held * TILE_ROWS
            prefix_lens = staging[plan_at : plan_at + rows]
            tiles = staging[plan_at + rows :].reshape(held, TILE_ROWS)
            plan = metas[self.plan_group].shared_prefix  # (the graph's key holds the group)
            prefix_lens[:n] = plan.prefix_lens.numpy()
            prefix_lens[n:] = 0
            tiles[: plan.tiles.shape[0]] = plan.tiles.numpy()
            tiles[plan.tiles.shape[0] :] = -1
        tables_at = (1 + len(metas)) * rows
        for g, meta in enumerate(metas):
            slots = staging[(1 + g) * rows : (2 + g) * rows]
            slots[:n] = meta.slot_mapping.numpy()
            slots[n:] = -1
            tables = staging[tables_at + g * rows * width :][: rows * width].reshape(rows, width)
            used = meta.block_tables.shape[1]
            tables[:n, :used] = meta.block_tables.numpy()
            tables[:n, used:] = 0
            tables[n:] = 0
        self.device_buffer[2 * rows :].copy_(self.host_buffer, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.input_ids[:n].copy_(input_ids)
        self.position_ids[:n].copy_(position_ids)
        if n < rows:
            self.input_ids[n:].zero_()
            self.position_ids[n:].zero_()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: StaticStep | StaticExtend
    output_type: type
    fields: dict  # the captured output's fields (logits: the graph rewrites it), cache left out
    cache_field: str | None  # the field that held the cache; each step puts its own there


class DecodeGraphs:
    """The captured decode graphs of one patched model.

    ``run_forward(static)`` must run the model's stock forward on the static buffers with
    the paged cache's step set to ``static.meta`` and return the model output. With
    ``capture=False`` every step runs ``run_forward`` eagerly on the same static, padded
    buffers (no graph): this checks the bucket padding and metadata path on any device.
    ``agree(ok) -> bool`` (tensor parallelism: True only when every rank's ``ok`` is True)
    settles each capture, and whether a new cache keeps the graphs, across processes, so that
    every rank replays the same graph or every rank runs eagerly: their collectives must stay
    paired.
    """

    def __init__(self, capture: bool = True, agree: Callable[[bool], bool] | None = None):
        self.capture = capture
        self.agree = agree
        self.side_stream = None  # where captures warm up (created on the first)
        self.pool = None
        self.graphs: dict[tuple, _Captured] = {}  # ("decode" | "extend", bucket, ...) -> graph
        self.cache = _dead_ref  # weakly: graphs must not keep a finished cache alive
        self.cache_signature = None
        # set at each generate call: the same cache may come back over moved weights
        self.recheck = False
        self.modes = None  # the numeric settings the last check saw (``follow``'s ``modes``)
        self.disabled_reason: str | None = None
        self.extend_disabled_reason: str | None = None  # extend captures failed: eager
        self.captures = 0
        self.replays = 0
        self.extend_replays = 0  # of replays, those of extend steps
        self.extends_seen: set[tuple] = set()  # keys met (an extend key is captured when met again)

    def reset(self) -> None:
        """Drop every graph (their memory returns to the allocator once nothing uses it).

        The next capture takes a fresh memory pool: capturing into a pool whose graphs are
        gone while some of its memory is still referenced is an error in PyTorch.
        """
        self.graphs.clear()
        self.extends_seen.clear()
        self.cache = _dead_ref
        self.cache_signature = None
        self.pool = None

    def follow(
        self, cache, signature: Callable[[object], object] | None = None, modes=None
    ) -> None:
        """Keep the graphs for ``cache`` only if ``signature(cache)`` (what the graphs'
        memory addresses depend on) equals the one they were captured under; checked on a
        new cache object, on the same one after ``recheck`` was set (once per generate call:
        ``model.half()`` or ``.to()`` between calls moves the weights under a cache the
        caller passes back), and when ``modes`` (given: settings the signature holds too,
        cheap to read at every step) differ from the last check's. Without ``signature``
        every new cache captures anew."""
        if cache is self.cache() and not self.recheck and (modes is None or modes == self.modes):
            return
        self.recheck = False
        self.modes = modes
        signature = signature(cache) if signature is not None else None
        keep = signature is not None and signature == self.cache_signature
        if self.agree is not None:
            # the addresses are each rank's own: one rank keeping its graphs while another
            # captures anew would pair their collectives wrongly
            keep = self.agree(keep)
        if not keep:
            if self.graphs:
                _log.info("decode graphs: %d dropped (new pools or weights)", len(self.graphs))
            self.reset()
        self.cache = weakref.ref(cache)
        self.cache_signature = signature

    def step(
        self, cache, host: StepMetadata, input_ids, position_ids, run_forward, signature=None,
        borrow: bool = False, modes=None,
    ):  # fmt: skip
        """Run one decode step (one column) or extend step (``column_bucket`` columns)
        whose host metadata ``host`` is already built; returns the model output with logits
        for the real rows only. ``signature`` as in ``follow``. ``borrow=True`` returns only
        the logits of the real rows, a view of the graph's output buffer that the next
        replay of the bucket overwrites (no copy, no model output built). ``modes`` as in
        ``follow``."""
        self.follow(cache, signature, modes)
        batch, columns = input_ids.shape
        width = host.block_tables.shape[1]
        rows = bucket_for(batch)
        if columns == 1:
            plan_group = plan_group_of(host)
            key = ("decode", rows, width, host.equal_lengths, plan_group)
        else:
            key = ("extend", rows, column_bucket(columns), width)
        captured = self.graphs.get(key)
        if captured is None:
            if columns == 1:
                static = StaticStep.allocate(
                    rows, width, input_ids.device, host.layer_groups, host.equal_lengths,
                    plan_group,
                )  # fmt: skip
            else:
                static = StaticExtend.allocate(*key[1:], input_ids.device)
            static.load(host, input_ids, position_ids)
            # An extend bucket is captured when it comes back: a capture costs about two
            # eager forwards, which a shape seen once (one prompt's length) never repays.
            again = columns == 1 or key in self.extends_seen
            self.extends_seen.add(key)
            if self.capture and again:
                return self._capture(key, static, run_forward, cache, batch, borrow)
            if not self.capture:  # (counted as the replay it stands for)
                self._count_replay(columns)
            return _eager_answer(run_forward(static), cache, batch, borrow)
        captured.static.load(host, input_ids, position_ids)
        captured.graph.replay()
        self._count_replay(columns)
        return _trim(captured, cache, batch, borrow)

    def _count_replay(self, columns: int) -> None:
        self.replays += 1
        self.extend_replays += columns > 1

    def _capture(self, key, static: StaticStep, run_forward, cache, batch: int, borrow: bool):
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels): this run
        # computes the real step, so it is also the answer if capture fails. One stream for
        # every capture: cuBLAS keeps a workspace per stream it meets, for the process's life.
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream()
        side = self.side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = run_forward(static)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        inner = None  # the forward's own error, which ending the capture may mask
        try:
            # thread_local: another thread's CUDA work during the capture does not break it
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                try:
                    output = run_forward(static)
                except Exception as error:
                    inner = error
                    raise
        except Exception as error:  # a model whose forward cannot be captured stays eager
            failure = inner or error
            end_generator_capture(static.input_ids.device)
        else:
            failure = None
        if self.agree is not None and not self.agree(failure is None) and failure is None:
            failure = RuntimeError("another tensor-parallel rank failed to capture this step")
        if failure is not None:
            reason = f"{type(failure).__name__}: {failure}"
            steps = f"{key[0]} steps"
            if key[0] == "decode":
                self.disabled_reason = reason
            else:
                self.extend_disabled_reason = reason
            _log.info("fallback: %s run eagerly (capture failed: %s)", steps, failure)
            warnings.warn(
                f"nanoserve: CUDA-graph capture failed, {steps} run eagerly ({reason})",
                stacklevel=3,
            )
            self.reset()
            return _eager_answer(warm, cache, batch, borrow)
        self.captures += 1
        captured = _Captured(graph, static, *_template(output, cache))
        self.graphs[key] = captured
        decode = key[0] == "decode"
        _log.info(
            "%s graph captured: batch bucket %d (batch %d), %sblock table width %d%s; %d held",
            key[0],
            key[1],
            batch,
            "" if decode else f"{key[2]} columns, ",
            key[2] if decode else key[3],
            ", rows of one length" if decode and key[3] else "",
            len(self.graphs),
        )
        graph.replay()
        self._count_replay(static.input_ids.shape[1])
        return _trim(captured, cache, batch, borrow)


def end_generator_capture(device: torch.device) -> None:
    """Take the device's CUDA generator out of capture mode after a failed capture: the
    failed ``capture_end`` raises before the epilogue that turns it off, and every random op
    of the process then failed ("Offset increment outside graph capture encountered
    unexpectedly"). An empty capture that ends cleanly runs that epilogue; should it fail
    too, the eager fallback goes on as before."""
    try:
        with torch.cuda.device(device):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.empty(1, device=device).zero_()
            del graph
    except Exception as error:
        _log.info("after a failed capture, the generator's capture mode stays on (%s)", error)


def _dead_ref():
    return None


def _template(output, cache) -> tuple[type, dict, str | None]:
    """(type, fields without the cache, the cache's field name) of a model output."""
    fields = dict(output.items())
    cache_field = next((k for k, v in fields.items() if v is cache), None)
    fields.pop(cache_field, None)
    return type(output), fields, cache_field


def _eager_answer(output, cache, batch: int, borrow: bool = False):
    """``_trim`` for an output computed eagerly (no captured graph behind it)."""
    return _trim(_Captured(None, None, *_template(output, cache)), cache, batch, borrow)


def _trim(captured: _Captured, cache, batch: int, borrow: bool = False):
    """The step's model output: logits of the first ``batch`` rows (cloned, since the next
    replay overwrites the static buffer) and ``cache`` in its field; with ``borrow`` only
    those logits, uncloned."""
    if borrow:
        return captured.fields["logits"][:batch]
    fields = dict(captured.fields)
    fields["logits"] = fields["logits"][:batch].clone()
    if captured.cache_field is not None:
        fields[captured.cache_field] = cache
    return captured.output_type(**fields)
