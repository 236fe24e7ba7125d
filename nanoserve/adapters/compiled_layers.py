"""torch.compile'd decoder layers for the decode steps that run as CUDA graphs (opt-in).

Under a CUDA graph, an eager decode step of a small model still costs the GPU a few µs for
each of its many tiny kernels (RMSNorm is about seven, rotary about a dozen, per layer).
With ``patch_model(..., compile_decode=True)`` the decoder layers go through ``torch.compile``
(inductor) while a decode step is warmed up and captured, so those element-wise ops fuse;
nanoserve's paged write and attention stay outside the compiled code (graph breaks, see
``hf_cache.PagedCache.update`` and ``attention.paged_attention``) and run its Triton
kernels. Prefill and every forward outside the graph runner stay eager.

Fused kernels round differently from eager PyTorch, so compiled steps are close to, not bit
for bit equal to, stock eager (as with transformers' own compiled static cache). A replay
equals the same compiled step run without a graph bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class CompiledLayers:
    """Compiled versions of ``layers``' forwards, swapped in only inside ``active()``.

    All layers share one compiled artifact per input shape (the same code, parameters as
    inputs), compiled on first use; a new batch bucket compiles once more.
    """

    def __init__(self, layers: Sequence[torch.nn.Module]):
        self.layers = list(layers)
        self.compiled = [torch.compile(layer.forward) for layer in self.layers]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = [layer.__dict__.get("forward") for layer in self.layers]
        for layer, forward in zip(self.layers, self.compiled, strict=True):
            layer.forward = forward
        try:
            with _one_artifact_for_all_layers():
                yield
        finally:
            for layer, forward in zip(self.layers, saved, strict=True):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward


def _one_artifact_for_all_layers():
    """Dynamo treats int attributes of modules as constants, so ``self.layer_idx`` (passed
    to the cache) would compile the attention once per layer and, past its recompile limit
    (8), leave the remaining layers uncompiled; tracing such ints as inputs avoids that."""
    config = torch._dynamo.config
    if not hasattr(config, "allow_unspec_int_on_nn_module"):
        return contextlib.nullcontext()
    return config.patch(allow_unspec_int_on_nn_module=True)
