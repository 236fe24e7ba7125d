"""PagedCache: a transformers ``Cache`` over nanoserve's ``PagedKVCache``.

HF counts a cache in columns of the padded batch (``get_seq_length`` slices the prompt and
sizes masks by it), while the paged store keeps only real tokens, so this class keeps both:
``columns`` (what HF sees) and the block tables (what is stored). The step boundary is
``begin_step`` (called once per forward by the patched model's forward, ``hf.py``) and
``end_step`` after it (``abort_step`` when the forward failed); every layer's ``update``
then scatters into its pool and returns the pools, which the attention function reads
through the step's block tables.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache

from nanoserve.adapters.fused_inputs import records_grad
from nanoserve.adapters.step import current_step
from nanoserve.cache import GroupedKVCache, PagedKVCache, StepMetadata


def cache_kwarg(model_class) -> str:
    """The name ``model_class.forward`` takes the cache by."""
    forward = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


class _NoLayers(list):
    """``PagedCache.layers``: empty (the keys and values live in paged pools), so that
    transformers' loops over a cache's layers find none; indexing it says where they are
    instead of a bare IndexError."""

    def __getitem__(self, index):
        raise IndexError(
            f"layers[{index!r}]: a PagedCache keeps its keys and values in nanoserve's paged "
            "pools, not in per-layer tensors: read them through cache.paged (its key_pools, "
            "value_pools and tables), or generate without patching for a transformers cache"
        )


class PagedCache(Cache):
    """HF cache interface for generate; storage is a ``PagedKVCache`` (``.paged``)."""

    is_compileable = False  # a compileable cache makes generate auto-compile the forward
    is_croppable = True

    def __init__(self, paged: PagedKVCache):
        if not isinstance(paged, (PagedKVCache, GroupedKVCache)):
            raise ValueError(f"paged: expected a PagedKVCache, got {type(paged).__name__}")
        super().__init__(layers=_NoLayers())
        self.paged = paged
        self.num_layers = paged.num_layers
        self.columns = 0  # padded columns seen by completed forwards
        self._pending = 0  # columns of the forward in flight
        self._lens_before: list[int] | None = None  # each row's tokens before that forward
        # what the first forward shared (shared_rows.py), and the salt naming this call's
        # cached prefixes (None: no prefix is looked up or published)
        self.rows_shared = 0  # rows that took another row's prefill
        # rows that found leading blocks stored: by an earlier call, or computed once in this
        # call for the prompts that share them
        self.prefix_hits = 0
        self.tokens_not_recomputed = 0
        self.prefix_salt: bytes | None = None
        # blocks this call needs unless its first forward shares copies (hf.py grows the
        # pool to it if that forward does not share); None when the pool needs no growth
        self.unshared_blocks: list[int] | None = None  # one entry per layer group
        # whether the patch that made this pool fixed its size (num_blocks / max_memory): a
        # pool made unfixed grows when passed back, even after a re-patch fixes the size
        self.pool_fixed = False
        # why the model's forward is random (a module drops out in training mode), or None:
        # then no row takes another's prefill, no decode step replays a graph and HF's loop
        # runs (rows leaving the batch would shift the dropout draws)
        self.drops_out: str | None = None
        # False until the first forward of a generate call has checked its whole mask
        self.mask_checked = False
        # what a replayed step would skip (graph_forward.replay_skips: a submodule's hook),
        # found at a generate call's start or at each forward outside one, or None; while
        # set, no step replays a graph
        self.hooked: str | None = None
        # the same phrase whether or not the patch replays graphs: while set, eager steps run
        # stock's modules too (a hook would see fused forwards' outputs: views of one
        # buffer, computed before its own sibling's input changed)
        self.submodule_hooks: str | None = None
        # what the model's hooks rule out (user_hooks.scan_hooks), found alike: a hook that
        # may compute rows apart (no row takes another's prefill or a stored prefix), and
        # one that would see the batch shrink (HF's loop runs, not nanoserve's)
        self.row_hooks: str | None = None
        self.batch_hooks: str | None = None
        self.generating = False  # inside a generate call (its start looked for hooks)
        # set when a later call took the pool of this cache, its call having raised: such a
        # cache holds nothing and may not be continued
        self.retired = False
        # inside a generate call, what its start read off the model's modules (a
        # ``model_walk.ModelWalk``); None outside one
        self.walk = None

    # -- the step boundary (once per forward) -----------------------------------------------

    def begin_step(self, new_token_mask: torch.Tensor, device: torch.device) -> StepMetadata:
        """Grow the tables for this forward's real tokens; ``new_token_mask`` bool [S, q]."""
        before = self.paged.seq_lens()
        step = self.paged.begin_step(new_token_mask, device)  # OutOfBlocks leaves all intact
        self._pending = new_token_mask.shape[1]
        self._lens_before = before
        return step

    def end_step(self, columns: int | None = None) -> None:
        """The forward is done: HF now sees ``columns`` more columns (default: the width of
        the step's mask; a forward that ran fewer columns than HF passed says how many)."""
        self.columns += self._pending if columns is None else columns
        self._pending = 0
        self._lens_before = None

    def discard_step(self) -> None:
        """Drop every sequence after a forward HF never sees (the shared prefix rows of
        ``shared_rows.py``): the columns stay as they were, published blocks stay findable."""
        self.paged.reset()
        self._pending = 0
        self._lens_before = None

    def abort_step(self) -> None:
        """Forget the tokens of a forward that failed after ``begin_step`` (some layers
        stored them, others not): every row is cut back to what it held before, so the
        cache can be continued, or a call retried, as if that forward never ran."""
        before, self._lens_before, self._pending = self._lens_before, None, 0
        if before is None:
            return
        if not before:  # the forward that started the sequences
            self.paged.reset()
            return
        self.paged.truncate_rows(before)
        self.paged.step = None

    def hold(self):
        """What ``restore`` puts back: the rows as they are now (``PagedKVCache.hold``: their
        blocks are kept from being freed or overwritten meanwhile) and the columns."""
        return self.paged.hold(), self.columns

    def restore(self, held) -> None:
        """The cache as ``hold`` found it (a failed generate call); ``release`` otherwise."""
        tables, self.columns = held
        self.paged.restore(tables)
        self._pending = 0
        self._lens_before = None

    def release(self, held) -> None:
        self.paged.release(held[0])

    @property
    def step(self) -> StepMetadata:
        return self.paged.step

    # -- what attention modules call ---------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter K/V [B, Hkv, q, D] of this step; returns the layer's pools
        [num_blocks, block_size, Hkv, D] (pads are dropped by slot -1)."""
        if torch.compiler.is_compiling():  # compile_decode: the paged write stays Triton
            return _update_uncompiled(self, key_states, value_states, layer_idx)
        step = current_step()
        if step is None or step.cache is not self:
            raise RuntimeError(
                "PagedCache.update outside a paged step: a PagedCache is driven by the forward "
                "of a model patched with nanoserve.patch_model (call the patched model, not its "
                "base model; after nanoserve.unpatch_model, patch the model again to continue "
                "this cache, or start a new call without it)"
            )
        batch, heads, q_len, head_dim = key_states.shape
        key = key_states.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
        value = value_states.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
        # (a torch step, where autograd records the forward, scatters by the reference too, and
        # so does a layer whose K/V autograd records though the step's inputs and weights do
        # not: a hook added a tensor that requires grad)
        backend = "torch" if step.backend == "torch" or records_grad(key, value) else None
        # (rows the layer's q/k/v launch stored already, when these are they: no scatter)
        stored = step.stored_rows.pop(layer_idx, None)
        target = stored.target_for(key_states, value_states) if stored is not None else None
        taken = self.paged.stores_taken
        pools = self.paged.write(layer_idx, key, value, check=False, backend=backend, stored=target)
        if self.paged.stores_taken > taken and stored.on_stored is not None:
            stored.on_stored()
        return pools

    # -- what generate and the mask code call ------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues old row ``beam_idx[i]`` (blocks shared, copy on write)."""
        self.paged.reorder([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.paged.reorder([int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.paged.reorder([i for i in range(self.paged.num_seqs) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (a positive value: keep that many).

        The dropped columns are taken to be real tokens in every row, which holds for what
        generate crops (generated tokens, never prompt padding). Under a sliding window a
        crop past the positions the window released (``activate_past_recording`` keeps them)
        raises a ValueError before anything changes.
        """
        tokens_to_remove = int(tokens_to_remove)  # 5.17's assisted decoding passes a tensor
        drop = -tokens_to_remove if tokens_to_remove <= 0 else self.columns - tokens_to_remove
        drop = max(0, min(drop, self.columns))
        if drop and not self.paged.can_drop_last(drop):
            # stock's sliding layers refuse such a crop too (a RuntimeError, 5.17 to 5.25)
            raise ValueError(
                f"tokens_to_remove: {tokens_to_remove} cuts the cache back past positions its "
                "sliding window already released; call cache.activate_past_recording() "
                "before those tokens are written to crop back that far, as on stock's "
                "sliding-window layers"
            )
        if drop:
            self.paged.drop_last(drop)
            self.columns -= drop
        if self.paged.window_held:  # as stock's recording sliding layers, back to the window
            self.paged.release_past_window()

    def reset(self) -> None:
        self.paged.reset()
        self.columns = 0
        self._pending = 0

    def activate_past_recording(self, **kwargs) -> None:
        """Let ``crop`` roll back any number of tokens, as stock's sliding-window layers do
        once recording: the sliding window's blocks are then released only at each crop.
        Transformers' own calls (5.25) name what they may roll back
        (``recurrent_states_to_keep``, for recurrent layers, which a paged cache has none
        of): the slack the pool keeps past the window covers it, and nothing changes; a
        caller's own loop names nothing."""
        if "recurrent_states_to_keep" not in kwargs:
            self.paged.hold_window()

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """Intermediate recurrent states to record (transformers 5.25): none, no layer of a
        paged cache is recurrent."""
        return 0

    # -- properties HF inspects ------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_initialized(self) -> bool:
        return self.paged.num_seqs > 0

    @property
    def batch_size(self) -> int:
        return self.paged.num_seqs or -1

    @property
    def max_batch_size(self) -> int:
        return self.paged.num_seqs

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers  # every token is kept; windows are applied in attention

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def note_shared(self, rows: int, hits: int, tokens: int) -> None:
        """``rows`` rows took another row's prefill, ``hits`` rows found cached leading
        blocks, ``tokens`` prompt tokens were not computed."""
        self.rows_shared += rows
        self.prefix_hits += hits
        self.tokens_not_recomputed += tokens

    def stats(self) -> dict[str, float]:
        """The store's figures (``PagedKVCache.stats``) plus what sharing saved
        (``rows_shared``, ``prefix_hits``, ``tokens_not_recomputed``) and the cached prefix
        blocks the pool holds (``cached_blocks``, of them ``evictable_blocks`` unused)."""
        stats = self.paged.stats()
        stats["rows_shared"] = self.rows_shared
        stats["prefix_hits"] = self.prefix_hits
        stats["tokens_not_recomputed"] = self.tokens_not_recomputed
        groups = self.paged.groups
        stats["cached_blocks"] = sum(g.allocator.num_cached for g in groups)
        stats["evictable_blocks"] = sum(g.allocator.num_evictable for g in groups)
        return stats

    def __repr__(self) -> str:
        return (
            f"PagedCache(layers={self.num_layers}, sequences={self.paged.num_seqs}, "
            f"columns={self.columns}, "
            f"blocks_used={sum(g.allocator.num_used for g in self.paged.groups)})"
        )


_update_uncompiled = torch.compiler.disable(PagedCache.update)
