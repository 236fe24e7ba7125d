"""Helpers for the adapter tests: run a generate call on the stock and the patched model."""

from __future__ import annotations

import importlib
import inspect
import os
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import transformers

import nanoserve


@contextmanager
def patched(model, **options):
    nanoserve.patch_model(model, **options)
    try:
        yield model
    finally:
        nanoserve.unpatch_model(model)


def cache_name(model) -> str:
    """How this transformers version's forward takes the cache (5.24: ``cache``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def sharpen(model):
    """Redraw ``model``'s matrices larger than HF's default init (std 1.5 / sqrt(fan-in)), so
    its logits are peaked and differences show in the tokens; returns ``model``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.5 / p.shape[1] ** 0.5)
    return model


def stock_and_paged(model, seed: int | None = None, patch_options=None, **kwargs):
    """(stock output, patched output) of ``model.generate(**kwargs)``; seeds each if asked."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        stock = model.generate(**kwargs)
    with patched(model, **(patch_options or {})), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        paged = model.generate(**kwargs)
    return stock, paged


class RecordingStreamer:
    """A streamer keeping a copy of every tensor generate puts, and whether it ended."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


class ForceTokens(transformers.LogitsProcessor):
    """Make generate pick ``target[:, L]`` at input length L (the raw logits stay as they are)."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        token = self.target[:, input_ids.shape[1]]
        return forced.scatter_(1, token[:, None], 0.0)


def chat(tokenizer, questions, **kwargs):
    """Left-padded chat prompts: dict(input_ids, attention_mask)."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    tokenizer.padding_side = "left"
    return dict(tokenizer(texts, return_tensors="pt", padding=True, **kwargs))


# -- which kernels ran: backend="auto" on CPU must run the torch references, "triton" the
# Triton kernels (under TRITON_INTERPRET=1), so a parametrization cannot silently run one
# where it claims the other

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

NEEDS_INTERPRETER = pytest.mark.skipif(
    not INTERPRETING, reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
BACKENDS = pytest.mark.parametrize(
    "backend", ["auto", pytest.param("triton", marks=NEEDS_INTERPRETER)]
)

_LAUNCHERS = {
    "decode": ("nanoserve.kernels.triton_decode", "paged_decode_attention_triton"),
    "extend": ("nanoserve.kernels.triton_extend", "paged_extend_attention_triton"),
    "scatter": ("nanoserve.kernels.triton_scatter", "slot_scatter_triton"),
}


def count_triton_launches(monkeypatch) -> Counter:
    """Wrap each Triton launcher (the public ops look them up at every call) so that it
    counts its calls; returns the live Counter {"decode": n, "extend": n, "scatter": n}."""
    launches: Counter = Counter()
    for kind, (module_name, name) in _LAUNCHERS.items():
        module = importlib.import_module(module_name)
        launcher = getattr(module, name)

        def counted(*args, _kind=kind, _launcher=launcher, **kwargs):
            launches[_kind] += 1
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return launches


def check_launches(launches: Counter, backend: str, kinds=("decode", "extend", "scatter")):
    """``backend="triton"``: every kernel of ``kinds`` was launched; otherwise (CPU tensors,
    "auto" or "torch") no Triton kernel was."""
    if backend == "triton":
        missing = [kind for kind in kinds if launches[kind] == 0]
        assert not missing, f"backend='triton' never launched {missing}: {dict(launches)}"
    else:
        assert sum(launches.values()) == 0, f"backend={backend!r} launched Triton: {launches}"


def spy_packed(monkeypatch, *fields):
    """A list that records each packed-kernel launch's keyword ``fields`` (one value, or a
    tuple of several) while the launch still runs."""
    from nanoserve.kernels import triton_verify

    calls = []
    real = triton_verify.paged_extend_attention_packed

    def spy(*args, **kwargs):
        values = tuple(kwargs[f] for f in fields)
        calls.append(values[0] if len(values) == 1 else values)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_verify, "paged_extend_attention_packed", spy)
    return calls
