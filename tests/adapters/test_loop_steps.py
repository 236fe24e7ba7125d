"""The decode loop's host-light steps: decode steps run straight on the graph runner
(``graph_forward.loop_decode_step``) and the greedy token choice on fixed buffers, replayed
as a graph (``loop_choice.TokenChoice``).

On CPU the graph runner executes its static buffers eagerly (``DecodeGraphs(capture=False)``)
and the choice's graphs are stood in for by a recorder whose replay runs the recorded
function again with the host values it was recorded with, as a replay would. The GPU test
captures and replays both.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import patched, sharpen
from test_decode_loop import EOS, eos_early, on_cuda, random_processors
from test_families import padded_batch, tiny_model
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

import nanoserve
from nanoserve.adapters import loop_choice
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.device_sampling import (
    StopRule,
    apply_steps,
    greedy_tokens,
    processor_steps,
)
from nanoserve.adapters.step import state_of

# rows ending at spread steps (EOS scaled), left padding, the batch compacted as rows end;
# the repetition penalty keeps state across steps and min_new_tokens changes its branch
OPTS = dict(max_new_tokens=30, repetition_penalty=1.3, min_new_tokens=5)


def stock_and_ours(model, inputs, graphs, **opts):
    """(stock's sequences, the patched loop's sequences, decode_graph_stats)."""
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    with patched(model):
        if graphs is not None:
            state_of(model).graphs = graphs
        with torch.no_grad():
            ours = model.generate(**inputs, **opts)
        return stock, ours, nanoserve.decode_graph_stats(model)


@pytest.mark.parametrize("lengths", [[13], [13, 6, 2]])
def test_direct_steps_give_stocks_tokens(lengths):
    """Every decode step of the loop runs straight on the graph runner's static buffers and
    the tokens are stock's. Planted: ``loop_decode_step`` refusing every step failed the
    count; the choice not moving the positions on failed the tokens."""
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0)
    inputs = padded_batch(lengths, 13)
    stock, ours, stats = stock_and_ours(model, inputs, DecodeGraphs(capture=False), **OPTS)
    assert torch.equal(stock, ours), (stock, ours)
    decode_steps = stats["replays"] - stats["extend_replays"]
    assert stats["decode_loop"] == "nanoserve"
    assert decode_steps > 5 and stats["loop_steps"]["direct"] == decode_steps, stats


def test_model_call_where_no_graph_runs():
    """Without a graph runner (CPU, default options) every step calls the model as before:
    no direct step, stock's tokens."""
    model = eos_early(tiny_model("llama", seed=10), 3.0)
    stock, ours, stats = stock_and_ours(model, padded_batch([13, 6, 2], 13), None, **OPTS)
    assert torch.equal(stock, ours)
    assert stats["loop_steps"] == {"direct": 0, "choice_replays": 0}, stats


class _Recorded:
    """A CPU stand-in for a captured graph: replay runs the recorded function again, with
    the host values (length, processors' branch) it was recorded with, and writes its
    output buffers in place."""

    def __init__(self, run, outputs):
        self.run, self.outputs = run, outputs

    def replay(self):
        for kept, new in zip(self.outputs, self.run(), strict=True):
            kept.copy_(new)


def recorder(state_tensors, calls: list):
    """``loop_choice._record``'s stand-in. A capture records without computing, so this one
    computes once for the output buffers and puts back the state it changed
    (``state_tensors()``: the buffers the choice updates in place)."""

    def record(run):
        calls.append(run)
        saved = [t.clone() for t in state_tensors()]
        outputs = tuple(t.clone() for t in run())
        for t, before in zip(state_tensors(), saved, strict=True):
            t.copy_(before)
        return _Recorded(run, outputs), outputs

    return record


def reference_choice(steps, rule, pad, logits, unfinished, length):
    """The loop's eager ops for one greedy step: (tokens, unfinished after it)."""
    processed = apply_steps(steps, logits.to(dtype=torch.float32), length)
    tokens = torch.where(unfinished, greedy_tokens(processed), pad)
    for step in steps:
        step.observe(tokens)
    return tokens, unfinished & rule.not_eos(tokens)


def test_replayed_choice_equals_eager_steps(monkeypatch):
    """Step after step over one lent logits buffer (refilled as a graph's output is), the
    replayed choice gives the eager ops' tokens, unfinished rows and positions, across the
    min_new_tokens boundary (EOS blocked, then winning) and with random processors.
    Planted: the processors' length branch left out of the graph key (EOS stayed blocked)
    failed."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    rows, vocab, prompt_len = 3, 97, 5
    for trial in range(6):
        ids = torch.randint(3, vocab, (rows, prompt_len), generator=gen)
        processors = [lp.MinNewTokensLengthLogitsProcessor(prompt_len, 4, EOS)]
        processors += random_processors(gen, prompt_len) if trial else []
        processors = LogitsProcessorList(processors)
        criteria = [sc.MaxLengthCriteria(40), sc.EosTokenCriteria(EOS)]
        rule, pad = StopRule(criteria, torch.device("cpu")), torch.tensor(0)
        ours, ref = processor_steps(processors, ids), processor_steps(processors, ids)
        unfinished = torch.ones(rows, dtype=torch.bool)
        positions = torch.full((rows, 1), prompt_len - 1)
        calls = []

        def state(ours=ours, unfinished=unfinished, positions=positions):
            seen = [s.seen for s in ours if getattr(s, "seen", None) is not None]
            return [unfinished, positions, *seen]

        monkeypatch.setattr(loop_choice, "_record", recorder(state, calls))
        choice = loop_choice.TokenChoice(ours, rule, pad, capture=True)
        lent = torch.empty(rows, vocab)
        ref_unfinished = unfinished.clone()
        for step in range(10):
            length = prompt_len + step
            lent.copy_(torch.randn(rows, vocab, generator=gen) * 2)
            lent[:, EOS] = lent.max() + 1  # EOS wins wherever it is not blocked
            expected, ref_unfinished = reference_choice(
                ref, rule, pad, lent, ref_unfinished, length
            )
            _, tokens = choice(lent, unfinished, positions, length, lent=True)
            assert torch.equal(tokens, expected), (seed, trial, step)
            assert torch.equal(unfinished, ref_unfinished), (seed, trial, step)
            assert torch.equal(positions[:, 0], torch.full((rows,), length)), (seed, step)
        # a capture per branch: min_new_tokens's two (and another length processor's)
        assert choice.replays >= 5 and len(calls) >= 2 and (trial or len(calls) == 2), seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths", [[13], [13, 6, 2]])
def test_gpu_replayed_steps_give_stocks_tokens(lengths):
    """On CUDA, float32: the decode steps replay straight from the loop and the token
    choice replays its own graphs (captured per bucket and branch); stock's tokens."""
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0).cuda()
    stock, ours, stats = stock_and_ours(model, on_cuda(padded_batch(lengths, 13)), None, **OPTS)
    assert torch.equal(stock, ours), (stock, ours)
    decode_steps = stats["replays"] - stats["extend_replays"]
    loop = stats["loop_steps"]
    assert decode_steps > 5 and loop["direct"] == decode_steps, stats
    assert loop["choice_replays"] > 0, stats
