"""Decode steps over rows that share a prompt's blocks read those blocks once (the
shared-prefix plan, ``StepMetadata.shared_prefix``), with stock's tokens: copies of a
prompt, ``num_return_sequences``, sampling, beams, the static (graph) buffers and the own
decode loop."""

from __future__ import annotations

import os

import numpy as np
import pytest
import test_new_families as new_families
import torch
from helpers import patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs, StaticStep, plan_group_of
from nanoserve.adapters.step import state_of
from nanoserve.cache import PagedKVCache
from nanoserve.cache.paged_cache import StepMetadata, grouped_metadata
from nanoserve.kernels import shared_prefix, triton_decode
from nanoserve.kernels.shared_prefix import SharedPrefixPlan

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def any_grid_takes_the_plan(monkeypatch):
    """These tiny batches run the prefix pass too (the launcher's rule otherwise keeps it to
    grids that fill the GPU)."""
    monkeypatch.setattr(shared_prefix, "SHARED_PREFIX_PROGRAMS_PER_SM", 0)


needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")


def spy_prefix_pass(monkeypatch) -> list[tuple[int, int]]:
    """A list receiving (rows with a prefix, tiles) of every prefix-pass launch."""
    calls, launcher = [], triton_decode.shared_prefix_partials

    def recording(query, key_cache, value_cache, block_tables, prefix_lens, tiles, **kwargs):
        # (a CUDA-graph capture may not read the device: it is recorded as None rows)
        capturing = prefix_lens.is_cuda and torch.cuda.is_current_stream_capturing()
        calls.append((None if capturing else int((prefix_lens > 0).sum()), tiles.shape[0]))
        return launcher(query, key_cache, value_cache, block_tables, prefix_lens, tiles, **kwargs)

    monkeypatch.setattr(triton_decode, "shared_prefix_partials", recording)
    return calls


# (rows of the batch as copies of the two prompts, generate's options)
CASES = {
    "greedy-copies": ([0, 1, 0, 0, 1], dict(do_sample=False)),
    "sampled-copies": ([0, 1], dict(do_sample=True, top_k=20, num_return_sequences=4)),
    "beams": ([0, 1], dict(do_sample=False, num_beams=3, num_return_sequences=2)),
}


@needs_interpreter
@pytest.mark.parametrize("graphs", ["eager", "static"])
@pytest.mark.parametrize("case", list(CASES))
def test_rows_of_one_prompt_read_its_blocks_once_with_stocks_tokens(case, graphs, monkeypatch):
    """Two prompts (13 and 9 tokens, blocks of 4) copied per row: every decode step runs the
    prefix pass over the copies' shared full blocks, and the tokens and logits are stock's.
    Planted: the decode kernel reading each row from its first token again (the prefix
    counted twice), and its fold of the pass's partials skipped: both failed here."""
    model = tiny_model("llama")
    order, options = CASES[case]
    inputs = {k: v[order] for k, v in padded_batch([13, 9], 13, seed=5).items()}
    opts = dict(max_new_tokens=6, eos_token_id=None, output_logits=True,
                return_dict_in_generate=True, **options)  # fmt: skip
    torch.manual_seed(3)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    calls = spy_prefix_pass(monkeypatch)
    with patched(model, block_size=4, backend="triton"), torch.no_grad():
        if graphs == "static":
            state_of(model).graphs = DecodeGraphs(capture=False)
        torch.manual_seed(3)
        paged = model.generate(**inputs, **opts)
    assert calls and all(rows >= 2 for rows, _ in calls), calls
    assert torch.equal(stock.sequences, paged.sequences)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@needs_interpreter
def test_reads_every_row_whole_when_switched_off(monkeypatch):
    model = tiny_model("llama")
    inputs = {k: v[[0, 1, 0, 1]] for k, v in padded_batch([13, 9], 13, seed=5).items()}
    opts = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    calls = spy_prefix_pass(monkeypatch)
    monkeypatch.setattr(PagedKVCache, "share_prefix_reads", False)
    with patched(model, block_size=4, backend="triton"), torch.no_grad():
        paged = model.generate(**inputs, **opts)
    assert calls == [] and torch.equal(stock, paged)


@needs_interpreter
def test_the_own_decode_loop_with_rows_ending_apart(monkeypatch):
    """Sampled copies of one prompt whose rows draw EOS at different steps: nanoserve's loop
    compacts its batch as rows finish, the plan follows the rows left, and the sequences are
    stock's."""
    model = tiny_model("llama", seed=10)
    with torch.no_grad():
        model.lm_head.weight[2] *= 3.0  # EOS likelier: rows end apart
    inputs = padded_batch([14], 14, seed=9)
    opts = dict(max_new_tokens=24, do_sample=True, num_return_sequences=6, eos_token_id=2)
    torch.manual_seed(1)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    ends = {int((row[14:] == 2).nonzero()[0]) if (row[14:] == 2).any() else -1 for row in stock}
    assert len(ends) >= 3, stock  # rows end at several steps
    calls = spy_prefix_pass(monkeypatch)
    with patched(model, block_size=4, backend="triton"), torch.no_grad():
        torch.manual_seed(1)
        paged = model.generate(**inputs, **opts)
        assert nanoserve.decode_graph_stats(model)["decode_loop"] == "nanoserve"
    assert len({rows for rows, _ in calls}) >= 2, calls  # the plan shrank with the batch
    assert torch.equal(stock, paged)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_quantized_pools_with_copies_of_a_prompt(kv_dtype, monkeypatch):
    """FP8 and INT8 pools take the plan (the prefix pass dequantizes as the decode kernel
    does): the tokens and logits are those of the same pools with shared-prefix reads off."""
    model = tiny_model("llama")
    inputs = {k: v[[0, 1, 0, 0, 1]] for k, v in padded_batch([13, 9], 13, seed=5).items()}
    opts = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, output_logits=True,
                return_dict_in_generate=True)  # fmt: skip
    runs, calls = {}, spy_prefix_pass(monkeypatch)
    for share in (False, True):
        monkeypatch.setattr(PagedKVCache, "share_prefix_reads", share)
        with patched(model, block_size=4, backend="triton", kv_dtype=kv_dtype), torch.no_grad():
            runs[share] = model.generate(**inputs, **opts)
    assert calls and all(rows == 5 for rows, _ in calls), calls
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for step, (a, b) in enumerate(zip(runs[False].logits, runs[True].logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@needs_interpreter
@pytest.mark.parametrize("graphs", ["eager", "static"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_global_layers_of_a_grouped_cache_read_shared_blocks_once(name, graphs, monkeypatch):
    """Gemma 2 / 3 (a global and a sliding layer group): the global layers' decode steps
    run the prefix pass, in eager steps and from the graph buffers (whose plan belongs to
    the global group), the sliding layers read rows whole (their window); the tokens and
    logits are stock's. Planted: the graph buffers holding no plan for a grouped cache (the
    rule before): the static cases failed."""
    model = new_families.tiny_model(name)
    inputs = {k: v[[0, 1, 0, 0, 1]] for k, v in padded_batch([13, 9], 13, seed=5).items()}
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=6, **new_families.LOGITS)
    calls = spy_prefix_pass(monkeypatch)
    with patched(model, block_size=4, backend="triton"), torch.no_grad():
        if graphs == "static":
            state_of(model).graphs = DecodeGraphs(capture=False)
        paged = model.generate(**inputs, max_new_tokens=6, **new_families.LOGITS)
        if graphs == "static":
            assert state_of(model).graphs.replays > 0  # the steps ran from the buffers
    assert calls and all(rows == 5 for rows, _ in calls), calls
    new_families.assert_logits_equal(stock, paged)


def test_graph_buffers_hold_the_plan_of_the_one_group_that_has_one():
    """``plan_group_of``: the group whose steps carry a plan, None where none does or where
    several do (buffers for one plan only: such steps read rows whole under a graph). The
    static buffers of a bucket of 4 rows, loaded with 3, give that group the host's plan
    (padding rows outside every tile) and every other group none. Planted: the buffers'
    plan always group 0's: failed on the plan in group 1."""
    rows, width = 3, 4

    def meta(group: int, with_plan: bool) -> StepMetadata:
        plan = None
        if with_plan:
            tiles = torch.full((2, 16), -1, dtype=torch.int32)
            tiles[0, :rows] = torch.arange(rows)
            plan = SharedPrefixPlan(torch.full((rows,), 8, dtype=torch.int32), tiles)
        tables = torch.arange(rows * 2, dtype=torch.int32).view(rows, 2) + 100 * (group + 1)
        return StepMetadata(
            torch.tensor([5, 6, 7]) + 10 * group, torch.arange(rows), tables,
            torch.tensor([9, 10, 11], dtype=torch.int32), torch.arange(rows + 1),
            all_single=True, shared_prefix=plan,
        )  # fmt: skip

    assert plan_group_of(meta(0, True)) == 0 and plan_group_of(meta(0, False)) is None
    assert plan_group_of(grouped_metadata((meta(0, True), meta(1, True)), (0, 1, 1))) is None
    for planned in ((False, True), (True, False)):
        host = grouped_metadata(tuple(meta(g, p) for g, p in enumerate(planned)), (0, 1, 1))
        group = plan_group_of(host)
        assert group == planned.index(True)
        static = StaticStep.allocate(4, width, torch.device("cpu"), host.layer_groups, False, group)
        ones = torch.ones(rows, 1, dtype=torch.long)
        static.load(host, ones, ones)
        static.device_buffer[2 * 4 :].copy_(static.host_buffer)  # (CPU: the copy is done)
        for g, held in enumerate(static.meta.group_metas):
            assert (
                held.block_tables[:rows, :2].tolist() == host.group_metas[g].block_tables.tolist()
            )
            if g != group:
                assert held.shared_prefix is None
                continue
            assert held.shared_prefix.prefix_lens.tolist() == [8, 8, 8, 0]
            tiles = held.shared_prefix.tiles
            assert tiles[0, :4].tolist() == [0, 1, 2, -1] and (tiles[1:] == -1).all()


def test_the_cache_keeps_its_plan_until_a_table_changes_what_it_shares():
    """A decode step's plan is computed once while the tables share the same blocks (fresh
    blocks at the end change nothing), and again after a cut back. Planted: the plan kept
    across the cut (no sharing_version bump in truncate): failed."""
    cache = PagedKVCache(num_layers=1, num_blocks=40, block_size=4)
    cache.begin_step(torch.ones(1, 10, dtype=torch.bool), "cpu")
    cache.reorder([0, 0, 0])  # rows 0, 1, 2 share 10 tokens (two full blocks and half a block)
    plans = []
    for _ in range(6):
        plans.append(cache.begin_step(torch.ones(3, 1, dtype=torch.bool), "cpu").shared_prefix)
    assert plans[0].prefix_lens.tolist() == [8, 8, 8]
    assert all(p is plans[1] for p in plans[1:])  # kept (step 0 swapped the shared tail)
    cache.truncate_rows([16, 4, 16])  # row 1 back to the first block: its next is fresh
    after = cache.begin_step(torch.ones(3, 1, dtype=torch.bool), "cpu").shared_prefix
    assert after is not plans[-1] and after.prefix_lens.tolist() == [4, 4, 4]
    tiles = after.tiles.numpy()
    assert sorted(tiles[tiles >= 0].tolist()) == [0, 1, 2]
    assert np.all(after.prefix_lens.numpy() < np.array(cache.seq_lens()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_replayed_decode_steps_with_a_shared_prefix_on_the_gpu(dtype, monkeypatch):
    """Copies of two prompts on CUDA: the decode steps are captured and replayed with the
    plan's buffers and run the prefix pass; float32 gives stock's tokens, and in both dtypes
    the replayed run gives the eager run's (graphs off) tokens."""
    model = tiny_model("llama").to("cuda", dtype)
    base = padded_batch([40, 23], 40, seed=6)
    inputs = {k: v[[0, 1, 0, 0, 1, 1, 0, 1]].cuda() for k, v in base.items()}
    opts = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    calls = spy_prefix_pass(monkeypatch)
    runs = {}
    for graphs in (False, True):
        with patched(model, block_size=16, cuda_graphs=graphs), torch.no_grad():
            runs[graphs] = model.generate(**inputs, **opts)
            stats = nanoserve.decode_graph_stats(model)
        assert (stats["replays"] > 0) == graphs and stats["disabled"] is None, stats
    assert None in [rows for rows, _ in calls], "no capture ran the prefix pass"
    assert calls and all(rows in (8, None) for rows, _ in calls), calls
    assert torch.equal(runs[True], runs[False])
    if dtype == torch.float32:
        assert torch.equal(runs[True], stock)


@pytest.mark.parametrize("rows", [7, 8])
def test_the_cache_plans_only_for_grids_the_launch_takes_a_plan_for(rows, monkeypatch):
    """The plan's rule (``takes_shared_prefix``) gates the host's planning too: on CPU (four
    nominal SMs, two programs an SM) 8 rows of one KV head get a plan and 7 none, so small
    batches spend no host time on plans their launch would not use."""
    monkeypatch.undo()
    cache = PagedKVCache(num_layers=1, num_blocks=60, block_size=4)
    cache.begin_step(torch.ones(1, 10, dtype=torch.bool), "cpu")
    cache.reorder([0] * rows)
    plan = cache.begin_step(torch.ones(rows, 1, dtype=torch.bool), "cpu").shared_prefix
    assert (plan is not None) == (rows >= 8)
