"""Patched generation under transformers' tensor parallelism: two gloo processes on CPU.

Every rank must make the same decisions (blocks, shared rows, cached prefixes, whether a
decode graph runs), talking only where a decision could differ (the call's options and
prefix salt, a graph capture), and give one process's tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import nanoserve

sys.path.insert(0, str(Path(__file__).parent))
from tp_worker import padded_batch, shared_prefix_prompts  # noqa: E402

WORKER = Path(__file__).with_name("tp_worker.py")
# vocab_size divides among the 2 ranks: transformers 5.17 shards the embedding evenly
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=104, max_position_embeddings=256)  # fmt: skip
GREEDY = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(one-process model, what each of the two ranks saw)."""
    folder = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(folder / "model")
    # (faulthandler: a rank that aborts natively prints its Python stack)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2"]  # fmt: skip
    cmd = [*launcher, str(WORKER), str(folder / "model"), str(folder)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return model, [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_greedy_equals_one_process(run):
    model, ranks = run
    ids, mask = padded_batch(CONFIG["vocab_size"])
    with torch.no_grad():
        one_process = model.generate(input_ids=ids, attention_mask=mask, **GREEDY).tolist()
    for rank in ranks:
        assert rank["world"] == 2
        assert rank["stock"] == one_process  # the sharded stock model agrees with one process
        assert rank["paged"] == one_process
        assert rank["graph_runner"] == one_process  # the static buffers a graph replays
        assert rank["graph_replays"] > 0
        assert rank["pool_shape"][2] == CONFIG["num_key_value_heads"] // 2  # a shard of heads
    assert ranks[0]["block_ids"] == ranks[1]["block_ids"]  # same decisions, no communication


def test_decode_loop_with_rows_ending_apart_equals_one_process(run):
    model, ranks = run
    ids, mask = padded_batch(CONFIG["vocab_size"])
    assert ranks[0]["eos"] == ranks[1]["eos"]
    with torch.no_grad():
        opts = dict(GREEDY, eos_token_id=ranks[0]["eos"])
        one_process = model.generate(input_ids=ids, attention_mask=mask, **opts).tolist()
    new_tokens = [row[ids.shape[1] :] for row in one_process]
    ends = {row.index(opts["eos_token_id"]) if opts["eos_token_id"] in row else None
            for row in new_tokens}  # fmt: skip
    assert len(ends) > 1 and ends != {None}  # rows finish at different steps (or not at all)
    for rank in ranks:
        assert rank["eos_loop"] == "nanoserve"
        assert rank["sampled_loop"] == "nanoserve"
        assert rank["eos_paged"] == one_process


def test_capture_agreement_is_all_or_none(run):
    _, ranks = run
    for rank in ranks:
        assert rank["agree_all"] is True
        assert rank["agree_one_fails"] is False  # rank 0 alone said no


def test_shared_rows_and_cached_prefixes_under_tensor_parallelism(run):
    model, ranks = run
    first, second = shared_prefix_prompts(CONFIG["vocab_size"])
    with torch.no_grad():
        expected = [model.generate(input_ids=p, **GREEDY).tolist() for p in (first, second)]
    for rank in ranks:
        assert rank["paged_sampled"] == rank["stock_sampled"]  # seeded, same RNG calls
        assert rank["sampled_rows_shared"] == 2  # 3 copies of the prompt, prefilled once
        assert [rank["prefix_first"], rank["prefix_second"]] == expected
        assert rank["prefix_hits"] == 1  # the second call found the shared blocks
        # one rank's shard changed: every rank misses (the ranks' salts are joined), so the
        # forwards stay of one length; planted to salt each rank alone, the run failed
        assert rank["changed_hits"] == 0
    assert ranks[0]["changed_second"] == ranks[1]["changed_second"]
    assert ranks[0]["paged_sampled"] == ranks[1]["paged_sampled"]


def test_one_rank_releasing_its_memory_makes_every_rank_miss(run):
    """Rank 0 alone calls release_memory: its cached prefixes are gone while rank 1's stay,
    so every rank must miss (the salt joins each rank's prefix-store identity) or their
    forwards differ in length. Found by review: rank 1 found the prefix, rank 0 did not, and
    the run crashed. Planted: the store identities left out of the joined salt: failed."""
    model, ranks = run
    _, second = shared_prefix_prompts(CONFIG["vocab_size"])
    with torch.no_grad():
        expected = model.generate(input_ids=second, **GREEDY).tolist()
    for rank in ranks:
        assert rank["again_hits"] == 1 and rank["again_second"] == expected
        assert rank["released_hits"] == 0 and rank["released_second"] == expected
        assert rank["worker_file"].startswith(str(Path(__file__).parents[2]))


def test_ranks_patched_with_other_options_refuse_the_call(run):
    """prefix_sharing on one rank only: every rank raises a ValueError naming it (review
    found such ranks hanging once one of them found a cached prefix). Planted: the options
    comparison removed: the call ran on both ranks, failed."""
    _, ranks = run
    for rank in ranks:
        assert rank["options_differ"].startswith("prefix_sharing: the tensor-parallel ranks")


def test_kv_heads_that_do_not_divide_among_ranks_raise():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model._tp_size = 4  # as a tp_plan model over 4 ranks records it
    with pytest.raises(ValueError, match="2 KV heads do not divide among 4"):
        nanoserve.patch_model(model)
    assert model.config._attn_implementation != "nanoserve_paged"
