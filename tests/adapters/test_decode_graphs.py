"""Decode steps through the CUDA-graph runner's static, bucket-padded buffers.

On CPU the runner executes those buffers eagerly (``DecodeGraphs(capture=False)``): the same
padding rows, slot -1, fixed-width tables and static metadata that a captured graph replays.
The GPU tests capture and replay real graphs.
"""

import contextlib

import pytest
import torch
from helpers import BACKENDS, check_launches, count_triton_launches, patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs, bucket_for
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 17, 33, 65, 128, 129, 300)] == [
        1, 2, 4, 8, 16, 32, 64, 128, 128, 256, 384,
    ]  # fmt: skip


def generate_patched(model, inputs, patch_options, graphs=None, **opts):
    """(generate output, decode_graph_stats) of the patched model; ``graphs`` replaces its
    graph runner (``DecodeGraphs(capture=False)`` runs the static buffers eagerly)."""
    nanoserve.patch_model(model, **patch_options)
    if graphs is not None:
        state_of(model).graphs = graphs
    try:
        with torch.no_grad():
            out = model.generate(**inputs, **opts)
        return out, nanoserve.decode_graph_stats(model)
    finally:
        nanoserve.unpatch_model(model)


def generate_with_static_buffers(model, inputs, backend="auto", **opts):
    patch = {"block_size": 4, "backend": backend}
    return generate_patched(model, inputs, patch, DecodeGraphs(capture=False), **opts)


@BACKENDS
@pytest.mark.parametrize("lengths", [[13], [13, 6, 2]])  # batch 3 pads the bucket of 4
def test_static_decode_path_matches_stock(lengths, backend, monkeypatch):
    """With backend="triton" the Triton decode kernel reads the static buffers (bucket
    padding rows of length 1, fixed-width tables). Planted: Triton decode dropping the
    newest key failed the triton cases; patch_model dropping ``backend`` failed them on the
    launch count."""
    model = tiny_model("llama")
    inputs = padded_batch(lengths, 13)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=9, **GREEDY)
    launches = count_triton_launches(monkeypatch)
    paged, stats = generate_with_static_buffers(model, inputs, backend, max_new_tokens=9, **GREEDY)
    check_launches(launches, backend)
    assert torch.equal(stock.sequences, paged.sequences)
    for a, b in zip(stock.logits, paged.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert stats["replays"] == 8  # every step after the prefill went through the buffers


@pytest.mark.parametrize(
    "lengths, equal", [([9, 9, 9], True), ([9, 4, 9], False), ([7], True)]
)  # three rows pad the bucket of four with rows of length 1: still rows of one length
def test_decode_steps_tell_attention_whether_the_rows_are_of_one_length(
    lengths, equal, monkeypatch
):  # fmt: skip
    """Every decode step through the static buffers passes ``equal_lengths`` (the launch
    form follows it) as the cache's step says, and keeps stock's tokens. Planted, reverted:
    the static step's metadata built without the flag: failed the equal cases."""
    from nanoserve.adapters import attention

    told = []
    decode = attention.paged_decode_attention

    def record(*args, equal_lengths, **kwargs):
        told.append(equal_lengths)
        return decode(*args, equal_lengths=equal_lengths, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", record)
    model = tiny_model("llama")
    inputs = padded_batch(lengths, 9)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=5, **GREEDY)
    paged, stats = generate_with_static_buffers(model, inputs, max_new_tokens=5, **GREEDY)
    assert torch.equal(stock.sequences, paged.sequences)
    assert stats["replays"] == 4
    layers = model.config.num_hidden_layers
    assert told == [equal] * 4 * layers


@BACKENDS
def test_static_decode_path_with_beams_matches_stock(backend, monkeypatch):
    model = tiny_model("llama")
    inputs = padded_batch([11, 5], 11)
    opts = dict(max_new_tokens=7, num_beams=3, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    launches = count_triton_launches(monkeypatch)
    paged, stats = generate_with_static_buffers(model, inputs, backend, **opts)
    check_launches(launches, backend)
    assert torch.equal(stock, paged)
    assert stats["replays"] == 6


def test_compiled_decode_layers_match_stock():
    """compile_decode: the static-buffer steps run torch.compile'd layers (inductor on CPU
    here) around the paged write and attention, which stay outside the compiled code."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", num_hidden_layers=12)
    inputs = padded_batch([13, 6, 2], 13)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=6, **GREEDY)
    graphs_before = counters["stats"]["unique_graphs"]
    paged, stats = generate_patched(
        model, inputs, {"compile_decode": True}, DecodeGraphs(capture=False),
        max_new_tokens=6, **GREEDY,
    )  # fmt: skip
    compiled = counters["stats"]["unique_graphs"] - graphs_before
    # the layers were compiled, and not once per layer (layer_idx traced as an input): a
    # graph per layer would also stop compiling at Dynamo's recompile limit of 8
    assert 0 < compiled <= 8, compiled
    assert stats["replays"] == 5
    assert torch.equal(stock.sequences, paged.sequences)
    for a, b in zip(stock.logits, paged.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_graphs_follow_the_signature_of_a_cache_passed_back():
    """Graphs stay while the cache's memory signature does; the same cache object is
    checked again once ``recheck`` is set (each generate call), so weights moved by
    ``model.half()`` / ``.to()`` between calls drop the graphs instead of replaying them."""

    class Cache:
        pass

    signature = ["weights at A"]
    graphs = DecodeGraphs(capture=False)

    def sig(cache):
        return signature[0]

    cache = Cache()
    graphs.follow(cache, sig)
    graphs.graphs[(1, 4)] = "a captured graph"
    graphs.follow(cache, sig)
    assert graphs.graphs  # same cache, same call
    signature[0] = "weights at B"
    graphs.recheck = True
    graphs.follow(cache, sig)
    assert not graphs.graphs and not graphs.recheck
    graphs.graphs[(1, 4)] = "a captured graph"
    graphs.recheck = True
    graphs.follow(cache, sig)
    assert graphs.graphs  # checked again, unchanged: kept
    other = Cache()
    graphs.follow(other, sig)
    assert graphs.graphs  # a new cache over the same memory keeps them too
    signature[0] = "weights at C"
    graphs.follow(Cache(), sig)
    assert not graphs.graphs


def test_no_graph_step_while_the_model_drops_out():
    """A model in training mode with dropout decodes eagerly (a replay would not draw its
    dropout as stock's eager step does) and gives stock's seeded tokens; in eval mode the
    graph runner serves the steps again. Planted: graph_step_possible ignoring
    cache.drops_out: the replay count was not 0."""
    from test_new_families import tiny_model as new_family_model

    model = new_family_model("phi3", resid_pdrop=0.1).train()
    inputs = padded_batch([7, 3], 7)
    opts = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    torch.manual_seed(3)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    torch.manual_seed(3)
    out, stats = generate_patched(model, inputs, {"block_size": 4}, DecodeGraphs(capture=False),
                                  **opts)  # fmt: skip
    assert stats["replays"] == 0 and torch.equal(out, stock)
    model.eval()
    _, stats = generate_patched(model, inputs, {"block_size": 4}, DecodeGraphs(capture=False),
                                **opts)  # fmt: skip
    assert stats["replays"] > 0


def test_each_generate_call_asks_for_a_recheck(monkeypatch):
    model = tiny_model("llama")
    inputs = padded_batch([7, 3], 7)
    seen = []
    follow = DecodeGraphs.follow
    monkeypatch.setattr(
        DecodeGraphs,
        "follow",
        lambda self, cache, *rest: (seen.append(self.recheck), follow(self, cache, *rest)),
    )
    opts = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    nanoserve.patch_model(model, block_size=4)
    state_of(model).graphs = DecodeGraphs(capture=False)
    try:
        with torch.no_grad():
            model.generate(**inputs, **opts)
            model.generate(**inputs, **opts)
    finally:
        nanoserve.unpatch_model(model)
    assert seen == [True, False, False] * 2  # three decode steps a call, the first rechecks


def test_next_call_reuses_the_pools_of_a_dropped_cache_only():
    """Same memory for the next call of the same pool size (what keeps captured graphs
    valid), unless the caller still holds the last cache, or the store inside it: that one
    is never touched."""
    model = tiny_model("llama")
    inputs = padded_batch([13, 6, 2], 13)
    opts = dict(max_new_tokens=5, do_sample=False, eos_token_id=None)
    nanoserve.patch_model(model, block_size=4)
    state = state_of(model)

    def first_pool():
        return state.kept_pools.pools[0][0]

    def unchanged(before, pools):
        return all(torch.equal(a, b) for a, b in zip(before, pools, strict=True))

    try:
        with torch.no_grad():
            first = model.generate(**inputs, **opts)
            pool = first_pool()
            assert nanoserve.adapters.last_cache(model) is None  # nothing holds it
            assert nanoserve.cache_stats(model)["tokens"] == 13 + 6 + 2 + 3 * 4
            second = model.generate(**inputs, **opts)
            assert first_pool() is pool
            held = model.generate(**inputs, return_dict_in_generate=True, **opts)
            assert first_pool() is pool
            held_cache = nanoserve.adapters.last_cache(model)  # held by the output object
            kept = [p.clone() for p in held_cache.paged.key_pools]
            fourth = model.generate(**inputs, **opts)
            assert first_pool() is not pool
            assert unchanged(kept, held_cache.paged.key_pools)
            held, held_cache = held.sequences, None
            out = model.generate(**inputs, return_dict_in_generate=True, **opts)
            store = nanoserve.adapters.last_cache(model).paged
            del out  # only the store inside the PagedCache is held now
            pool, kept = first_pool(), [p.clone() for p in store.key_pools]
            model.generate(**inputs, **opts)
            assert first_pool() is not pool
            assert unchanged(kept, store.key_pools)
            longer = model.generate(**inputs, **{**opts, "max_new_tokens": 9})
    finally:
        nanoserve.unpatch_model(model)
    with torch.no_grad():
        stock_longer = model.generate(**inputs, **{**opts, "max_new_tokens": 9})
    for out in (second, held, fourth):
        assert torch.equal(first, out)
    assert torch.equal(longer, stock_longer)


@pytest.mark.parametrize("others_keep", [True, False])
def test_a_new_cache_keeps_the_graphs_only_when_every_rank_does(others_keep):
    """Tensor parallelism: whether a new cache keeps the graphs (its pools at the addresses
    they were captured over) is each rank's own finding, settled across ranks. Planted:
    ignoring the agreement kept this rank's graphs while another rank dropped its own."""
    asked = []

    def agree(keep):
        asked.append(keep)
        return keep and others_keep

    class Cache:  # any object a weak reference can follow
        pass

    graphs = DecodeGraphs(capture=False, agree=agree)
    first, second = Cache(), Cache()
    graphs.follow(first, signature=lambda cache: "pools at A")
    graphs.graphs[(1, 8)] = "a captured step"
    graphs.follow(second, signature=lambda cache: "pools at A")  # this rank would keep them
    assert asked == [False, True]
    assert bool(graphs.graphs) == others_keep


def test_cuda_graphs_argument_and_unpatch():
    model = tiny_model("llama")
    forward = model.forward
    with pytest.raises(ValueError, match="cuda_graphs"):
        nanoserve.patch_model(model, cuda_graphs="yes")
    with pytest.raises(ValueError, match="compile_decode"):
        nanoserve.patch_model(model, compile_decode=1)
    with pytest.raises(ValueError, match="compile_decode: needs cuda_graphs"):
        nanoserve.patch_model(model, cuda_graphs=False, compile_decode=True)
    nanoserve.patch_model(model)
    assert "forward" in model.__dict__
    nanoserve.unpatch_model(model)
    assert "forward" not in model.__dict__ and model.forward == forward
    nanoserve.patch_model(model, cuda_graphs=False)
    assert state_of(model).graphs is None
    assert nanoserve.decode_graph_stats(model)["enabled"] is False
    nanoserve.unpatch_model(model)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                         max_position_embeddings=2048)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(dtype).eval()


def _run(model, inputs, cuda_graphs, fuse_decode=True, **opts):
    patch = {"cuda_graphs": cuda_graphs, "fuse_decode": fuse_decode}
    return generate_patched(model, inputs, patch, **opts)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_decode_equals_eager_bit_for_bit(dtype, fuse):
    """A replay runs what the eager step runs, with fuse_decode's forwards or without them
    (an eager step leaves the residual adds apart, which changes no bit; test_gpu_parity
    holds the fused steps to stock)."""
    model = _gpu_model(dtype)
    inputs = {k: v.cuda() for k, v in padded_batch([40, 23, 7, 31], 40, vocab=1000).items()}
    eager, _ = _run(model, inputs, False, fuse_decode=fuse, max_new_tokens=48, **GREEDY)
    graph, stats = _run(model, inputs, True, fuse_decode=fuse, max_new_tokens=48, **GREEDY)
    assert stats["captures"] == 1 and stats["replays"] == 47, stats
    assert torch.equal(eager.sequences, graph.sequences)
    for a, b in zip(eager.logits, graph.logits, strict=True):
        assert torch.equal(a, b)  # batch 4 is a bucket: the same kernels on the same shapes


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("others_agree", [True, False])
def test_a_capture_another_rank_refuses_decodes_eagerly(others_agree):
    """Tensor parallelism settles each capture across ranks (``agree``): when another rank
    failed, this one drops its good graph and decodes eagerly with the same tokens. Planted:
    ignoring the agreement's answer failed the False case."""
    model = _gpu_model(torch.float32)
    inputs = {k: v.cuda() for k, v in padded_batch([40, 23, 7, 31], 40, vocab=1000).items()}
    eager, _ = _run(model, inputs, False, max_new_tokens=12, **GREEDY)
    asked = []

    def agree(ok):
        asked.append(ok)
        return ok and others_agree

    refused = pytest.warns(UserWarning, match="another tensor-parallel rank")
    with contextlib.nullcontext() if others_agree else refused:
        graph, stats = generate_patched(
            model, inputs, {}, DecodeGraphs(agree=agree), max_new_tokens=12, **GREEDY
        )
    assert asked == [False, True]  # the new cache keeps no graphs; one capture
    assert stats["captures"] == (1 if others_agree else 0)
    assert (stats["disabled"] is None) == others_agree
    assert torch.equal(eager.sequences, graph.sequences)
    for a, b in zip(eager.logits, graph.logits, strict=True):
        assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
def test_graph_decode_between_buckets_beams_and_repeated_calls():
    model = _gpu_model(torch.float32)
    inputs = {k: v.cuda() for k, v in padded_batch([30, 9, 17], 30, vocab=1000).items()}
    opts = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    first, stats = _run(model, inputs, True, **opts)
    assert torch.equal(stock, first) and stats["replays"] == 23
    nanoserve.patch_model(model)
    try:
        with torch.no_grad():
            again = [model.generate(**inputs, **opts) for _ in range(2)]
        beams = model.generate(**inputs, num_beams=3, **opts)
        stats = nanoserve.decode_graph_stats(model)
    finally:
        nanoserve.unpatch_model(model)
    assert all(torch.equal(stock, out) for out in again)
    with torch.no_grad():
        stock_beams = model.generate(**inputs, num_beams=3, **opts)
    assert torch.equal(stock_beams, beams)
    # the second call reuses the first call's pools, so its graphs; beams need a larger pool
    assert stats["captures"] == 2 and stats["disabled"] is None, stats


@gpu
@pytest.mark.gpu
def test_graph_decode_batch_one_after_a_short_call():
    """A short call captures, the next call's fresh cache captures anew (a new pool)."""
    model = _gpu_model(torch.bfloat16)
    short = {k: v.cuda() for k, v in padded_batch([8], 8, vocab=1000).items()}
    long = {k: v.cuda() for k, v in padded_batch([300], 300, vocab=1000).items()}
    opts = dict(do_sample=False, eos_token_id=None)
    eager, _ = _run(model, long, False, fuse_decode=False, max_new_tokens=40, **opts)
    nanoserve.patch_model(model, fuse_decode=False)  # graph steps run the eager step's kernels
    try:
        with torch.no_grad():
            model.generate(**short, max_new_tokens=2, **opts)
            graph = model.generate(**long, max_new_tokens=40, **opts)
        stats = nanoserve.decode_graph_stats(model)
    finally:
        nanoserve.unpatch_model(model)
    assert stats["disabled"] is None and stats["captures"] == 2, stats
    assert torch.equal(eager, graph)


@gpu
@pytest.mark.gpu
def test_compiled_decode_replay_equals_compiled_eager_bit_for_bit():
    model = _gpu_model(torch.bfloat16)
    inputs = {k: v.cuda() for k, v in padded_batch([40, 23, 7, 31], 40, vocab=1000).items()}
    opts = dict(max_new_tokens=32, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    patch = {"compile_decode": True}
    eager, _ = generate_patched(model, inputs, patch, DecodeGraphs(capture=False), **opts)
    graph, stats = generate_patched(model, inputs, patch, **opts)
    assert stats["captures"] == 1 and stats["replays"] == 31, stats
    assert torch.equal(eager.sequences, graph.sequences)
    for a, b in zip(eager.logits, graph.logits, strict=True):
        assert torch.equal(a, b)
    check_close_to_stock(stock, graph, inputs["input_ids"].shape[1], tol=0.05)


def check_close_to_stock(stock, paged, prompt_len: int, tol: float) -> None:
    """Logits that round differently from stock's (bf16, fused kernels) but no more than
    that: at every step where a row's tokens so far are stock's (later logits answer another
    context), max |paged - stock| over the row <= ``tol`` x the row's largest |stock logit|.
    (bf16 keeps 8 significant bits, 0.4% a rounding; stock vs compile_decode on a 4-layer
    model differed by about 1% of the row's largest logit in a CPU bf16 run, hence 5%.)
    Greedy tokens: each row follows stock at least until stock's own top two logits come
    within 2 * tol (a near tie that rounding may break either way); step 0 of every row is
    always compared."""
    new = paged.sequences[:, prompt_len:]
    agreed = (new == stock.sequences[:, prompt_len:]).long().cumprod(dim=1).sum(dim=1)
    steps = len(stock.logits)
    assert len(paged.logits) == steps and new.shape[1] == steps
    first_tie = torch.full_like(agreed, steps)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        a, b = a.float(), b.float()
        bound = tol * a.abs().amax(dim=1)
        top2 = a.topk(2, dim=1).values
        tie = (top2[:, 0] - top2[:, 1] <= 2 * bound) & (first_tie == steps)
        first_tie[tie] = step
        rows = agreed >= step  # this row's context is still stock's
        err = (b - a).abs().amax(dim=1)
        assert (err[rows] <= bound[rows]).all(), (
            f"step {step}: rows {rows.nonzero().flatten().tolist()} max |diff| "
            f"{err[rows].tolist()} > {bound[rows].tolist()}"
        )
    assert (agreed >= first_tie).all(), (agreed.tolist(), first_tie.tolist())


@gpu
@pytest.mark.gpu
def test_a_failed_capture_leaves_random_ops_working():
    """A forward that cannot be captured (dynamic rope reads a tensor on the host) decodes
    eagerly. The failed capture had left the CUDA generator in capture mode, and every
    later random op of the process failed ("Offset increment outside graph capture
    encountered unexpectedly": a GPU probe, sampling and torch.randn alike)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                         max_position_embeddings=24, rope_parameters=rope)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    inputs = {k: v.cuda() for k, v in padded_batch([30, 9], 30, vocab=1000).items()}
    with pytest.warns(UserWarning, match="CUDA-graph capture failed"):
        _, stats = _run(model, inputs, True, max_new_tokens=8, **GREEDY)
    assert stats["captures"] == 0 and stats["disabled"] is not None
    assert torch.randn(4, device="cuda").isfinite().all()
    with patched(model), torch.no_grad():
        sampled = model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=5)
    assert sampled.shape == (2, 38)
