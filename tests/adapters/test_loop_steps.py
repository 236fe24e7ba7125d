"""The decode loop's host-light steps: decode steps run straight on the graph runner
(``graph_forward.loop_decode_step``) and the greedy token choice on fixed buffers, replayed
as a graph (``loop_choice.TokenChoice``).

On CPU the graph runner executes its static buffers eagerly (``DecodeGraphs(capture=False)``)
and the choice's graphs are stood in for by a recorder whose replay runs the recorded
function again with the host values it was recorded with, as a replay would. The GPU test
captures and replays both.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import patched, sharpen
from test_decode_graphs import generate_patched
from test_decode_loop import (
    EOS,
    PER_ROW_IGNORE,
    eos_early,
    nan_sampling,
    on_cuda,
    random_processors,
)
from test_families import padded_batch, tiny_model
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

import nanoserve
from nanoserve.adapters import decode_graphs, decode_loop, loop_choice
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.device_sampling import (
    INVALID_PROBABILITIES,
    StopRule,
    apply_steps,
    processor_steps,
)
from nanoserve.adapters.step import state_of

# rows ending at spread steps (EOS scaled), left padding, the batch compacted as rows end;
# the repetition penalty keeps state across steps and min_new_tokens changes its branch
OPTS = dict(max_new_tokens=30, repetition_penalty=1.3, min_new_tokens=5)


def stock_and_ours(model, inputs, graphs, **opts):
    """(stock's output, the patched loop's output, decode_graph_stats); ``graphs`` replaces
    the graph runner (None: the patched model's own)."""
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    return (stock, *generate_patched(model, inputs, {}, graphs, **opts))


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


@pytest.mark.parametrize(
    "opts",
    [
        {},  # three rows of one prompt: the first forward shares its blocks
        dict(return_dict_in_generate=True, output_scores=True, output_logits=True),
    ],
)
def test_direct_steps_with_shared_prompts_and_returned_scores(opts):
    """Copies of a prompt (their first forward shares blocks, the pool was sized for the
    copies) and a call returning its scores and logits (the choice stays eager, the rows stay
    in the batch) also run their decode steps straight on the graph runner, with stock's
    tokens, scores and logits. Planted: the direct step refused while the pool's unshared
    sizing was set (as it is for the whole call after a shared first forward) failed the
    count."""
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0)
    inputs = {k: v[[0, 0, 0, 1]] for k, v in padded_batch([60, 40], 60).items()}
    opts = dict(OPTS, **opts)
    stock, ours, stats = stock_and_ours(model, inputs, DecodeGraphs(capture=False), **opts)
    if isinstance(stock, torch.Tensor):
        assert torch.equal(stock, ours), (stock, ours)
    else:
        assert torch.equal(stock.sequences, ours.sequences)
        for field in ("scores", "logits"):
            for a, b in zip(getattr(stock, field), getattr(ours, field), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    decode_steps = stats["replays"] - stats["extend_replays"]
    assert decode_steps > 5 and stats["loop_steps"]["direct"] == decode_steps, stats


def test_model_call_where_no_graph_runs():
    """Without a graph runner (CPU, default options) every step calls the model as before:
    no direct step, stock's tokens."""
    model = eos_early(tiny_model("llama", seed=10), 3.0)
    stock, ours, stats = stock_and_ours(model, padded_batch([13, 6, 2], 13), None, **OPTS)
    assert torch.equal(stock, ours)
    assert stats["loop_steps"]["direct"] == 0, stats


class _Recorded:
    """A CPU stand-in for a captured graph: replay runs the recorded function again with the
    arguments and host values (length, processors' branch) it was recorded with, and writes
    its output buffers in place. A graph reads and writes fixed addresses: the buffers it
    updates must still be the recorded ones at each replay."""

    def __init__(self, run, args, outputs, buffers):
        self.run, self.args, self.outputs, self.buffers = run, args, outputs, buffers
        self.addresses = [t.data_ptr() for t in buffers()]

    def replay(self):
        assert [t.data_ptr() for t in self.buffers()] == self.addresses, "a buffer moved"
        for kept, new in zip(self.outputs, self.run(*self.args), strict=True):
            if kept is not None:
                kept.copy_(new)


def recorder(calls: list):
    """``loop_choice._record``'s stand-in. A capture records without computing, so this one
    computes once for the output buffers and puts back the buffers the choice updates in
    place (the unfinished rows, the positions, the processors' state) and the random state
    (a captured draw moves the generator only when replayed)."""

    def record(run, args, kept):
        choice, (_, unfinished, positions, _) = run.__self__, args

        def buffers():
            seen = [s.seen for s in choice.steps if getattr(s, "seen", None) is not None]
            return [unfinished, positions, *seen]

        calls.append(args)
        saved = [t.clone() for t in buffers()]
        random_state = torch.get_rng_state()
        result = run(*args)
        outputs = type(result)._make(t.clone() if t is not None else None for t in result)
        torch.set_rng_state(random_state)
        for t, before in zip(buffers(), saved, strict=True):
            t.copy_(before)
        return _Recorded(run, args, outputs, buffers), outputs

    return record


@pytest.fixture
def lent_on_cpu(monkeypatch):
    """The loop on CPU as on CUDA: the graph runner lends each step's logits from a fixed
    buffer per shape (a captured graph's output), and the choice captures (stand-in
    recorder). Yields the recorder's calls."""
    buffers = {}
    eager_answer = decode_graphs._eager_answer

    def lend(output, cache, batch, borrow=False):
        if not borrow:
            return eager_answer(output, cache, batch)
        logits = output.logits
        if logits.shape not in buffers:
            buffers[logits.shape] = torch.empty_like(logits)
        return buffers[logits.shape].copy_(logits)[:batch]

    calls = []
    monkeypatch.setattr(decode_graphs, "_eager_answer", lend)
    monkeypatch.setattr(decode_loop, "_captures", lambda model, device: True)
    monkeypatch.setattr(loop_choice, "_record", recorder(calls))
    return calls


@pytest.mark.parametrize(
    "lengths, opts",
    [
        ([13], OPTS),
        ([13, 6, 2], OPTS),  # compacted twice
        ([13, 6, 2, 9, 4], dict(max_new_tokens=30, repetition_penalty=1.3, min_length=20)),
        ([13, 6, 2, 9, 4, 11, 3, 7, 12], dict(max_new_tokens=40)),
        # 12 EOS ids: torch.isin would sort and read back to the host in a capture
        ([13, 6, 2, 9, 4], dict(max_new_tokens=25, eos_token_id=[2, *range(40, 51)])),
    ],
)
def test_replayed_choice_in_the_loop_gives_stocks_tokens(lengths, opts, lent_on_cpu):
    """The whole loop with lent logits buffers and the choice replayed: stock's tokens
    through compaction, processors' branches and several EOS ids. Planted: no pad after
    EOS in the choice failed."""
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0)
    inputs = padded_batch(lengths, 13)
    stock, ours, stats = stock_and_ours(model, inputs, DecodeGraphs(capture=False), **opts)
    assert torch.equal(stock, ours), (stock, ours)
    assert stats["loop_steps"]["choice_replays"] > 0 and lent_on_cpu, stats


def test_each_batch_size_captures_its_choice_into_a_new_pool(lent_on_cpu, monkeypatch):
    """A compacted batch's choice is captured anew into a memory pool of its own (PyTorch
    refuses a capture into a pool whose graphs are gone while some of its memory is still
    held, and a refused capture leaves the rest of the call choosing eagerly); the stats
    count the captures and name no failure. Planted: the pool kept across compactions
    failed."""
    pools = []
    stand_in = loop_choice._record

    def record(run, args, kept):
        if not kept:  # as ``_record`` makes them: at the first capture into ``kept``
            kept["pool"] = object()
        pools.append((args[0].shape[0], kept["pool"]))  # (batch rows, pool)
        return stand_in(run, args, kept)

    monkeypatch.setattr(loop_choice, "_record", record)
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0)
    inputs = padded_batch([13, 6, 2], 13)
    stock, ours, stats = stock_and_ours(model, inputs, DecodeGraphs(capture=False), **OPTS)
    assert torch.equal(stock, ours)
    loop = stats["loop_steps"]
    assert loop["choice_captures"] == len(pools) == len(lent_on_cpu), loop
    assert len({rows for rows, _ in pools}) >= 2 and loop["choice_failed"] is None, pools
    for rows, pool in pools:  # one pool per batch size
        assert all(other is not pool for r, other in pools if r != rows)


SAMPLED = [
    # rows that end at spread steps leave the batch (on most seeds)
    ([13, 6, 2], dict(OPTS, do_sample=True, top_k=20, temperature=0.8)),
    # 12 EOS ids, top-p and min-p: every row ends before max_new_tokens, so the loop issues
    # steps past the stop and gives their draws back
    (
        [13, 6, 2, 9, 4],
        dict(
            do_sample=True,
            top_p=0.9,
            min_p=0.05,
            max_new_tokens=40,
            eos_token_id=[2, *range(40, 51)],
        ),
    ),
]


def seeded_stock_and_ours(model, inputs, graphs, seed: int, **opts):
    """``stock_and_ours`` with the global seed set before each call: (stock's output, its
    random state after the call, ours, our random state after it, our stats)."""
    cuda = next(model.parameters()).is_cuda
    state = torch.cuda.get_rng_state if cuda else torch.get_rng_state
    torch.manual_seed(seed)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    stock_state = state()
    torch.manual_seed(seed)
    ours, stats = generate_patched(model, inputs, {}, graphs, **opts)
    return stock, stock_state, ours, state(), stats


@pytest.mark.parametrize("lengths, opts", SAMPLED)
def test_replayed_sampled_choice_gives_stocks_tokens(lengths, opts, lent_on_cpu):
    """Seeded sampling through the replayed choice (softmax and draw in the graph), the
    batch compacted as rows end: stock's tokens, and the random state after the call is
    stock's (the draws of the steps issued past the stop given back). Planted: the random
    state kept after the choice instead of before it failed the state."""
    model = eos_early(tiny_model("llama", seed=10), 5.0)
    seed = int.from_bytes(os.urandom(4), "little")
    stock, stock_state, ours, our_state, stats = seeded_stock_and_ours(
        model, padded_batch(lengths, 13), DecodeGraphs(capture=False), seed, **opts
    )
    assert torch.equal(stock, ours), (seed, stock, ours)
    assert torch.equal(stock_state, our_state), seed
    assert stats["loop_steps"]["choice_replays"] > 0 and lent_on_cpu, stats


def test_nan_through_the_replayed_choice_raises_as_stock(lent_on_cpu):
    """A NaN distribution met by a replayed sampled choice (its flag a graph's buffer,
    read back a few steps later): stock's error, and the random state where stock's raise
    leaves it. Planted: the replayed choice returning no flag (None) failed."""
    model, _, _, run = nan_sampling()
    stock_message, stock_after = run()
    assert INVALID_PROBABILITIES in stock_message
    with patched(model):
        state_of(model).graphs = DecodeGraphs(capture=False)
        message, after = run()
        stats = nanoserve.decode_graph_stats(model)
    assert message == INVALID_PROBABILITIES
    assert torch.equal(after, stock_after)
    assert stats["loop_steps"]["choice_replays"] > 0 and lent_on_cpu, stats


def test_failed_choice_capture_runs_eagerly(lent_on_cpu, monkeypatch):
    """A capture that fails leaves the choice eager for the rest of the call: stock's
    tokens, no replay."""

    def failing(run, args, kept):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(loop_choice, "_record", failing)
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0)
    inputs = padded_batch([13, 6, 2], 13)
    stock, ours, stats = stock_and_ours(model, inputs, DecodeGraphs(capture=False), **OPTS)
    assert torch.equal(stock, ours)
    assert stats["loop_steps"]["choice_replays"] == 0 and stats["loop_steps"]["direct"] > 0


def hooked_on_the_model(model, calls: list):
    """A forward hook on the model that the loop lets through (named as transformers'
    output capturing, which a replay may skip); returns its handle."""

    def hook(module, args, kwargs, output):
        calls.append(1)

    hook.__module__ = "transformers.utils.output_capturing"
    return model.register_forward_hook(hook, with_kwargs=True)


def wrapped_after_patching(model, calls: list):
    """The patched forward wrapped after patching by a wrapper the loop lets through (named
    as torch's autocast decorator, which changes no row's values); returns a handle whose
    ``remove`` puts the patched forward back."""
    inner = model.forward

    @functools.wraps(inner)  # (generate reads forward's parameters)
    def wrapped(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    wrapped.__module__ = "torch.amp.autocast_mode"
    model.forward = wrapped

    class Handle:
        def remove(self):
            model.forward = inner

    return Handle()


@pytest.mark.parametrize("install", [hooked_on_the_model, wrapped_after_patching])
def test_a_hook_or_wrapper_on_the_model_runs_at_every_step(install):
    """What the model call runs around the patched forward, a hook or a wrapper, runs at
    every decode step: the loop then calls the model, never the graph runner straight.
    Planted: ``plain_call`` always True failed the hook's count."""
    model = eos_early(sharpen(tiny_model("llama", seed=10)), 3.0)
    inputs = padded_batch([13, 6, 2], 13)
    with torch.no_grad():
        stock = model.generate(**inputs, **OPTS)
    calls = []
    with patched(model):
        state_of(model).graphs = DecodeGraphs(capture=False)
        handle = install(model, calls)
        try:
            with torch.no_grad():
                ours = model.generate(**inputs, **OPTS)
        finally:
            handle.remove()
        stats = nanoserve.decode_graph_stats(model)
    assert torch.equal(stock, ours)
    decode_steps = stats["replays"] - stats["extend_replays"]
    assert stats["decode_loop"] == "nanoserve", stats
    assert stats["loop_steps"]["direct"] == 0 and decode_steps > 5, stats
    assert len(calls) == 1 + decode_steps, (len(calls), stats)


def reference_choice(steps, rule, pad, logits, unfinished, length):
    """The loop's eager ops for one greedy step: (tokens, unfinished after it)."""
    processed = apply_steps(steps, logits.to(dtype=torch.float32), length)
    tokens = torch.where(unfinished, torch.argmax(processed, dim=-1), pad)
    for step in steps:
        step.observe(tokens, length)
    return tokens, unfinished & (tokens[:, None] != rule.eos[None, :]).all(dim=1)


def test_replayed_choice_equals_eager_steps(monkeypatch):
    """Step after step over one lent logits buffer (refilled as a graph's output is), the
    replayed choice gives the eager ops' tokens, unfinished rows and positions, across the
    min_new_tokens boundary (EOS blocked, then winning) and with random processors.
    Planted: the processors' length branch left out of the graph key (EOS stayed blocked)
    failed; the repetition penalty's state rebound out of place at each step failed (a
    graph would keep writing the old buffer)."""
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
        calls = []
        monkeypatch.setattr(loop_choice, "_record", recorder(calls))
        choice = loop_choice.TokenChoice(ours, rule, pad, capture=True)
        lent = torch.empty(rows, vocab)
        unfinished = torch.ones(rows, dtype=torch.bool)
        positions = torch.full((rows, 1), prompt_len - 1)
        ref_unfinished = unfinished.clone()
        for step in range(10):
            length = prompt_len + step
            lent.copy_(torch.randn(rows, vocab, generator=gen) * 2)
            lent[:, EOS] = lent.max() + 1  # EOS wins wherever it is not blocked
            expected, ref_unfinished = reference_choice(
                ref, rule, pad, lent, ref_unfinished, length
            )
            tokens = choice(lent, unfinished, positions, length, lent=True).tokens
            assert torch.equal(tokens, expected), (seed, trial, step)
            assert torch.equal(unfinished, ref_unfinished), (seed, trial, step)
            assert torch.equal(positions[:, 0], torch.full((rows,), length)), (seed, step)
        # a capture per branch met twice: min_new_tokens's two alone; with a penalty that
        # ignores columns past the prompt per row, the lengths before its last ignored
        # column are branches of their own (eager), which can leave one capture
        assert choice.replays >= 5 and len(calls) >= 1 and (trial or len(calls) == 2), seed


@pytest.mark.parametrize("ignore", [7, [6, 8]], ids=["int", "per-row"])
def test_replayed_penalty_ignores_the_columns_before_prompt_ignore_length(ignore, monkeypatch):
    """A repetition penalty whose ``prompt_ignore_length`` lies past the prompt (5 columns):
    a token chosen before that column never counts, one chosen from it on does, as stock
    slices the growing ``input_ids`` (a probe found every chosen token counted: other
    tokens). Token 3 leads token 4 by 5 to 4 at every step, so the tokens tell when 3 began
    to count; replayed choices keep to it. Planted, reverted: the penalty's ``branch`` left
    out (a choice captured while the column was ignored replayed after it): failed."""
    if not isinstance(ignore, int) and not PER_ROW_IGNORE:
        pytest.skip("this transformers takes prompt_ignore_length as an int only")
    rows, vocab, prompt_len = 2, 16, 5
    ignore_length = ignore if isinstance(ignore, int) else torch.tensor(ignore)
    processors = LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(10.0, ignore_length)])
    ids = torch.zeros(rows, prompt_len, dtype=torch.int64)
    rule = StopRule([sc.MaxLengthCriteria(40)], torch.device("cpu"))
    calls = []
    monkeypatch.setattr(loop_choice, "_record", recorder(calls))
    choice = loop_choice.TokenChoice(processor_steps(processors, ids), rule, None, capture=True)
    lent = torch.zeros(rows, vocab)
    unfinished = torch.ones(rows, dtype=torch.bool)
    positions = torch.full((rows, 1), prompt_len - 1)
    for _ in range(10):
        length = ids.shape[1]
        lent.zero_()
        lent[:, 3], lent[:, 4] = 5.0, 4.0
        expected = processors(ids, lent.clone()).argmax(dim=-1)
        tokens = choice(lent, unfinished, positions, length, lent=True).tokens
        assert torch.equal(tokens, expected), (length, tokens, expected)
        ids = torch.cat([ids, tokens[:, None]], dim=1)
    assert choice.replays > 0
    firsts = [row.tolist().index(4) for row in ids]  # the column of each row's first 4
    assert firsts == ([8, 8] if isinstance(ignore, int) else [7, 9]), ids


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths, opts", SAMPLED)
def test_gpu_replayed_sampled_choice_gives_stocks_tokens(lengths, opts):
    """On CUDA, float32: seeded sampling with the choice captured and replayed (its draws
    take the CUDA generator's offsets as the eager ops do), the batch compacted as rows end:
    stock's tokens and stock's random state after the call."""
    model = eos_early(tiny_model("llama", seed=10), 5.0).cuda()
    seed = int.from_bytes(os.urandom(4), "little")
    stock, stock_state, ours, our_state, stats = seeded_stock_and_ours(
        model, on_cuda(padded_batch(lengths, 13)), None, seed, **opts
    )
    assert torch.equal(stock, ours), (seed, stock, ours)
    assert torch.equal(stock_state, our_state), seed
    decode_steps = stats["replays"] - stats["extend_replays"]
    loop = stats["loop_steps"]
    assert decode_steps > 5 and loop["direct"] == decode_steps, stats
    assert loop["choice_replays"] > 0, stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("failing_capture", [1, 2])
def test_gpu_sampled_choice_whose_capture_fails_mid_call_gives_stocks_tokens(
    failing_capture, monkeypatch
):
    """On CUDA, seeded sampling where the ``failing_capture``-th capture of the choice fails
    inside the capture, after its draw was recorded (a host sync, which capture refuses):
    the call goes on eagerly with stock's tokens and ends with stock's random state (the
    failed capture took no offset from the generator)."""
    record, calls = loop_choice._record, []

    def failing_at(run, args, kept):
        calls.append(1)
        if len(calls) != failing_capture:
            return record(run, args, kept)

        def run_then_sync(*a):
            outputs = run(*a)
            outputs.tokens.sum().item()  # refused while the stream captures
            return outputs

        return record(run_then_sync, args, kept)

    monkeypatch.setattr(loop_choice, "_record", failing_at)
    model = eos_early(tiny_model("llama", seed=10), 5.0).cuda()
    lengths, opts = SAMPLED[0]
    seed = int.from_bytes(os.urandom(4), "little")
    stock, stock_state, ours, our_state, stats = seeded_stock_and_ours(
        model, on_cuda(padded_batch(lengths, 13)), None, seed, **opts
    )
    assert torch.equal(stock, ours), (seed, stock, ours)
    assert torch.equal(stock_state, our_state), seed
    loop = stats["loop_steps"]
    assert len(calls) >= failing_capture and loop["choice_failed"], (calls, stats)
    assert loop["choice_captures"] == failing_capture - 1, stats
