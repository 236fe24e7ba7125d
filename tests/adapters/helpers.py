"""Helpers for the adapter tests: run a generate call on the stock and the patched model."""

from __future__ import annotations

from contextlib import contextmanager

import torch

import nanoserve


@contextmanager
def patched(model, **options):
    nanoserve.patch_model(model, **options)
    try:
        yield model
    finally:
        nanoserve.unpatch_model(model)


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
