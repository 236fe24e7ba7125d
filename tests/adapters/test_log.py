"""The ``nanoserve`` logger: quiet by default; at INFO it says the pool size and why, the
prefixes found, the door taken; ``NANOSERVE_LOG=info`` prints it on stderr."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import patched
from test_families import GREEDY, padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.hf_cache import cache_kwarg
from nanoserve.log import ROOT, configure_from_env


def messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith(ROOT))


def test_quiet_by_default(caplog):
    model = tiny_model("llama")
    with patched(model), torch.no_grad():
        model.generate(**padded_batch([3, 5], 5), max_new_tokens=3, **GREEDY)
    assert messages(caplog) == ""


def test_pool_size_and_why(caplog):
    caplog.set_level(logging.INFO, logger=ROOT)
    model = tiny_model("llama")
    batch = padded_batch([3, 5], 5)
    with patched(model), torch.no_grad():
        model.generate(**batch, max_new_tokens=3, **GREEDY)
    assert "pool: 8 blocks of 16 tokens: 2 needed (2 rows, 8 prompt tokens, up to 3 new" in (
        messages(caplog)
    )
    caplog.clear()
    with patched(model, num_blocks=12), torch.no_grad():
        model.generate(**batch, max_new_tokens=3, **GREEDY)
    assert "pool: 12 blocks of 16 tokens (num_blocks)" in messages(caplog)
    caplog.clear()
    with patched(model, max_memory=2**16), torch.no_grad():
        model.generate(**batch, max_new_tokens=3, **GREEDY)
    assert "pool: 8 blocks of 16 tokens, what fits in max_memory=65536 bytes" in messages(caplog)


def test_shared_rows_and_prefix_hits(caplog):
    """Two copies of a 21-token prompt: one row copies the other, and the pool's size is
    logged once; the next call finds the first 16 tokens (one full block) in the kept pool.
    Planted: the unshared sizing logged at INFO again: failed on the count."""
    caplog.set_level(logging.INFO, logger=ROOT)
    model = tiny_model("llama")
    prompt = padded_batch([21], 21)["input_ids"]
    with patched(model), torch.no_grad():
        model.generate(prompt.repeat(2, 1), max_new_tokens=2, **GREEDY)
        assert "first forward: 1 rows copy another, 0 rows found 0 cached" in messages(caplog)
        # one pool line a call (the unshared size, sized too, is not logged at INFO)
        pool_lines = [line for line in messages(caplog).splitlines() if line.startswith("pool:")]
        assert len(pool_lines) == 1 and "copies of a prompt stored once" in pool_lines[0]
        caplog.clear()
        model.generate(prompt, max_new_tokens=2, **GREEDY)
        assert "first forward: 0 rows copy another, 1 rows found 16 cached" in messages(caplog)


def test_why_a_stored_prefix_is_not_found(caplog):
    """A call whose salt differs from the last call's says which part changed: a weight
    updated in place, a module attribute, a wrapper set on ``model.forward`` whose closure
    counts calls (as a timer's does: every call then misses what the one before stored),
    and nothing while the model stays as it was. Planted: the log line dropped, and the
    structure's change named as the weights': failed."""
    caplog.set_level(logging.INFO, logger=ROOT)
    model = tiny_model("llama")
    prompt = padded_batch([21], 21)["input_ids"]

    def changes(before=None) -> list[str]:
        if before is not None:
            before()
        caplog.clear()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=2, **GREEDY)
        return [m for m in messages(caplog).splitlines() if m.startswith("prefix cache: ")]

    def counting_wrapper():
        patched_forward, calls = model.forward, [0]

        def forward(*args, **kwargs):
            calls[0] += 1
            return patched_forward(*args, **kwargs)

        model.forward = forward

    def edit_weight():
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(1.01)

    with patched(model):
        assert changes() == []
        assert changes() == []
        (line,) = changes(edit_weight)
        assert "in-place version (weights updated?) changed since the last call" in line
        (line,) = changes(lambda: setattr(model.model.norm, "variance_epsilon", 1e-3))
        assert line.startswith("prefix cache: LlamaRMSNorm.variance_epsilon changed")
        (line,) = changes(counting_wrapper)
        assert line.startswith("prefix cache: LlamaForCausalLM.forward changed")
        (line,) = changes()  # the wrapper's count moved on
        assert line.startswith("prefix cache: LlamaForCausalLM.forward changed")


def test_door_is_logged(caplog, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path)
    caplog.set_level(logging.INFO, logger=ROOT)
    AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="nanoserve")
    assert 'LlamaForCausalLM: attn_implementation="nanoserve", patched with PagedConfig(' in (
        messages(caplog)
    )


SCRIPT = textwrap.dedent(
    """
    import torch, transformers
    import nanoserve
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = nanoserve.patch_model(transformers.LlamaForCausalLM(config).eval())
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    """
)


@pytest.mark.parametrize("level", ["info", "", "loud"])
def test_environment_variable(level):
    env = {**os.environ, "NANOSERVE_LOG": level}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith(ROOT)]
    if level == "info":
        assert any(line.startswith("nanoserve.adapters.sizing: pool: 8 blocks") for line in lines)
    else:
        assert lines == [], result.stderr
    assert ("NANOSERVE_LOG: unknown level 'loud'" in result.stderr) == (level == "loud")


def test_configure_adds_one_handler():
    logger = logging.getLogger(ROOT)
    before = (logger.level, list(logger.handlers))
    try:
        configure_from_env({"NANOSERVE_LOG": "debug"})
        configure_from_env({"NANOSERVE_LOG": "info"})
        assert logger.level == logging.INFO
        assert len(logger.handlers) == len(before[1]) + 1
    finally:
        logger.setLevel(before[0])
        logger.handlers[:] = before[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_captures_are_logged_per_bucket(caplog):
    caplog.set_level(logging.INFO, logger=ROOT)
    model = tiny_model("llama").cuda()
    batch = {k: v.cuda() for k, v in padded_batch([3, 5, 4], 5).items()}
    with patched(model), torch.no_grad():
        model.generate(**batch, max_new_tokens=4, **GREEDY)
    assert "decode graph captured: batch bucket 4 (batch 3), block table width" in messages(caplog)


def test_kept_pool_and_fallbacks(caplog):
    from transformers import DynamicCache

    caplog.set_level(logging.INFO, logger=ROOT)
    model = tiny_model("llama")
    batch = padded_batch([3, 5], 5)
    with patched(model), torch.no_grad():
        model.generate(**batch, max_new_tokens=3, **GREEDY)
        caplog.clear()
        model.generate(**batch, max_new_tokens=3, **GREEDY)
        assert "pool: the kept pool of 8 blocks serves this call (8 asked for)" in messages(caplog)
        caplog.clear()
        own = {cache_kwarg(type(model)): DynamicCache()}
        model.generate(**batch, max_new_tokens=3, **own, **GREEDY)
        assert "fallback: stock generate (the caller's own cache)" in messages(caplog)
        caplog.clear()
        model.generate(**batch, max_new_tokens=3, use_cache=False, **GREEDY)
        assert "fallback: stock generate (use_cache=False)" in messages(caplog)
        # a processor of the caller's own: transformers' decode loop (was not logged)
        from transformers import LogitsProcessor, LogitsProcessorList

        class Keep(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores

        caplog.clear()
        keep = LogitsProcessorList([Keep()])
        model.generate(**batch, max_new_tokens=3, logits_processor=keep, **GREEDY)
        loop = nanoserve.decode_graph_stats(model)["decode_loop"]
        assert loop.startswith("stock: ")
        assert f"fallback: transformers' decode loop ({loop[len('stock: ') :]})" in messages(caplog)
