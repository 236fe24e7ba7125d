"""Llama's rotary embedding computed by the q/k/v projections' launch in a fused step.

A Llama-family attention module projects q, k and v, views q and k as heads
(``.view(B, S, -1, D).transpose(1, 2)``) and calls ``apply_rotary_pos_emb(q, k, cos, sin)``
with the cos and sin its model's rotary embedding module made for the step. Inside
``FusedDecode.active()`` the step's tables are noted when that module returns them, the
projections' one launch (``small_batch_linear_rotary``) also writes q and k rotated with
them, and the rotary stand-in (``fused_rotary.py``) returns those instead of launching the
rotation, but only when it is handed exactly what the launch made: q and k the head views of
the projections' outputs as the module forms them, and the very cos and sin tensors, their
version counters unmoved. Anything else (a q or k normalized first, as Qwen3's; one written
in place where autograd counts it; other tables) is rotated by its own launch as before.
The launch rotates ahead only for an attention module that runs transformers' own forward,
which writes neither between the projections and the rotation, and only while no hook could
(``_Siblings._rotates_ahead``): a version counter does not see every write (an inference
tensor keeps none; a ``.data`` write moves none). The rotated values are bit-equal to that
launch's.

Where the step's paged cache offers the layer's pools (``PagedKVCache.store_target``), the
same launch stores k rotated and v at the step's slots too. When the rotation is taken, the
step notes the rows (``Stored``), and the cache's ``update`` skips its scatter only if it is
handed exactly those views, unwritten since; otherwise it scatters what it is given over
what the launch stored (the step's own slots, which hold nothing read before this layer's
write).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nanoserve.adapters.fused_inputs import version_counter as _version
from nanoserve.kernels.slot_scatter import KVStore
from nanoserve.kernels.small_batch_linear import rotary_problem


class _Launch(NamedTuple):
    q: torch.Tensor  # the q projection's output [B, S, N_q], as returned to the module
    k: torch.Tensor
    q_rotated: torch.Tensor  # [M, N_q]
    k_rotated: torch.Tensor
    cos: torch.Tensor  # the step's tables [B, S, D], as the rotary embedding returned them
    sin: torch.Tensor
    versions: tuple  # of the projections' output, cos and sin at the launch
    v: torch.Tensor | None = None  # the v projection's output [B, S, N_v]
    store: KVStore | None = None  # where the launch stored k rotated and v
    layer: int | None = None  # the attention module's layer index


class Stored(NamedTuple):
    """Rows a q/k/v launch stored in a layer's pools: k rotated and v as the attention
    module holds them ([B, Hkv, S, D] views), the ``KVStore`` they went to, and the version
    counters of the launch's outputs (k rotated's, and the projections' that v views) when
    the rotation was taken."""

    key: torch.Tensor
    value: torch.Tensor
    target: KVStore
    versions: tuple
    on_stored: Callable[[], None] | None = None  # called when the cache took them

    def target_for(self, key: torch.Tensor, value: torch.Tensor) -> KVStore | None:
        """The target for ``write(..., stored=)`` when ``key`` and ``value`` are the stored
        rows' views, unwritten since; else None (the caller scatters them)."""
        if not (_same_view(key, self.key) and _same_view(value, self.value)):
            return None
        if (_version(key), _version(value)) != self.versions:
            return None
        return self.target


def _current_step():
    """The paged step in flight, or None (imported here: step.py imports this module's user)."""
    from nanoserve.adapters.step import current_step

    return current_step()


def _heads(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, S, N] viewed as the attention module views it: [B, N / dim, S, dim]."""
    return t.view(*t.shape[:-1], -1, dim).transpose(1, 2)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same elements of the same memory (the same view, maybe two objects)."""
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


class QKVRotary:
    """The step's rotary tables and the latest projections' launch that rotated q and k.
    ``enabled``: the rotary stand-in runs this step (else nothing is rotated ahead)."""

    def __init__(self):
        self.enabled = False
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.launch: _Launch | None = None
        self.on_stored: Callable[[], None] | None = None

    def reset(self, enabled: bool = False, on_stored: Callable[[], None] | None = None) -> None:
        """A new step (``enabled``: its rotary stand-in runs); ``on_stored()`` is called
        each time the cache takes rows a launch stored instead of scattering them."""
        self.enabled, self.tables, self.launch = enabled, None, None
        self.on_stored = on_stored

    def note_tables(self, cos, sin) -> None:
        """The rotary embedding module returned (cos, sin) for this step."""
        self.tables = (cos, sin) if self.enabled else None

    def tables_for(
        self, x: torch.Tensor, flat_x: torch.Tensor, weights
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's (cos, sin) as [M, D] views for the projections of ``x`` [B, S, K]
        (``flat_x``: its rows [M, K]) by ``weights`` (q, k, v), or None when they do not serve
        them."""
        if self.tables is None or x.dim() != 3:
            return None
        cos, sin = self.tables
        if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
            return None
        if cos.dim() != 3 or cos.shape[:2] != x.shape[:2] or sin.shape != cos.shape:
            return None
        rows = x.shape[0] * x.shape[1]
        try:
            tables = cos.view(rows, cos.shape[-1]), sin.view(rows, sin.shape[-1])
        except RuntimeError:  # (not viewable as rows: a copy would cost the launch it saves)
            return None
        if rotary_problem(flat_x, weights, *tables) is not None:
            return None
        return tables

    def store_target(self, attention, x: torch.Tensor, weights) -> KVStore | None:
        """Where the launch for ``attention``'s projections of ``x`` by ``weights`` (q, k,
        v) may store k rotated and v: its layer's pools in the step's paged cache, if that
        cache offers them (``PagedKVCache.store_target``); else None."""
        step = _current_step()
        layer = getattr(attention, "layer_idx", None)
        # (the paged cache's store: ``PagedKVCache`` or ``GroupedKVCache``)
        offer = getattr(getattr(getattr(step, "cache", None), "paged", None), "store_target", None)
        if step is None or type(layer) is not int or offer is None:
            return None
        if step.backend == "torch" or self.tables is None:  # (autograd records the step)
            return None
        dim = self.tables[0].shape[-1]
        heads = weights[1].shape[0] // dim
        if weights[2].shape[0] != heads * dim:
            return None
        rows = x.shape[0] * x.shape[1]
        return offer(layer, rows, x.dtype, x.device, heads, dim)

    def keep(self, q, k, q_rotated, k_rotated, out, *, v=None, store=None, layer=None) -> None:
        """A launch made q and k (views of ``out``) and rotated them with the step's tables;
        with ``store`` it also stored k rotated and v (``out``'s view) for layer ``layer``."""
        cos, sin = self.tables
        versions = (_version(out), _version(cos), _version(sin))
        self.launch = _Launch(q, k, q_rotated, k_rotated, cos, sin, versions, v, store, layer)

    def take(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q and k rotated, [B, H, S, D] as the rotation returns them, when (q, k, cos, sin)
        are what the latest launch rotated (each launch's at most once); else None. Rows the
        launch stored are noted on the step for the cache's ``update``."""
        launch, self.launch = self.launch, None
        if launch is None or cos is not launch.cos or sin is not launch.sin:
            return None
        dim = cos.shape[-1]
        versions = (_version(launch.q), _version(cos), _version(sin))
        if versions != launch.versions:
            return None
        if not (_same_view(q, _heads(launch.q, dim)) and _same_view(k, _heads(launch.k, dim))):
            return None
        shape = launch.q.shape[:-1]
        q_rotated = _heads(launch.q_rotated.view(*shape, -1), dim)
        k_rotated = _heads(launch.k_rotated.view(*shape, -1), dim)
        step = _current_step()
        if launch.store is not None and step is not None:
            value = _heads(launch.v, dim)
            versions = (_version(k_rotated), _version(value))
            stored = Stored(k_rotated, value, launch.store, versions, self.on_stored)
            step.stored_rows[launch.layer] = stored
        return q_rotated, k_rotated
