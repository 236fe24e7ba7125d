"""One rank of the tensor-parallel tests (run by torchrun from test_tensor_parallel.py).

Loads the saved model with transformers' tensor parallelism (gloo on CPU), generates on the
stock model and the patched one, and writes what each rank saw to ``OUT/rank<r>.json``:
greedy tokens on a left-padded batch (eager steps, and the CUDA-graph runner's static-buffer
path with the ranks' capture agreement; rows ending at different steps in nanoserve's decode
loop), the agreement itself, seeded sampling with
``num_return_sequences`` (copies of a prompt prefilled once), two calls whose prompts
share leading blocks (the second one's prefix found in the first one's pool), a call after
one rank alone released its memory or had a weight shard changed, and ranks patched with
other options.
Usage: torchrun --nproc_per_node N tp_worker.py MODEL_FOLDER OUT_FOLDER
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout under test

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.step import state_of
from nanoserve.adapters.tensor_parallel import capture_agreement


def padded_batch(vocab: int):
    """The left-padded greedy batch the test also runs in one process."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    return ids, mask


def shared_prefix_prompts(vocab: int):
    """Two prompts with the same 9 leading tokens (two full blocks of 4), then their own."""
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, vocab, (9,), generator=gen)
    return [torch.cat([prefix, torch.randint(3, vocab, (n,), generator=gen)])[None] for n in (3, 5)]


def main(folder: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    rank = dist.get_rank()
    vocab = model.config.vocab_size
    ids, mask = padded_batch(vocab)
    greedy = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    sampled = dict(max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3,
                   eos_token_id=None, pad_token_id=0)  # fmt: skip
    seen = dict(rank=rank, world=dist.get_world_size(), worker_file=nanoserve.__file__)
    with torch.no_grad():
        seen["stock"] = model.generate(input_ids=ids, attention_mask=mask, **greedy).tolist()
        torch.manual_seed(11)
        seen["stock_sampled"] = model.generate(input_ids=ids[:1], **sampled).tolist()

        nanoserve.patch_model(model, block_size=4)
        result = model.generate(
            input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **greedy
        )
        seen["paged"] = result.sequences.tolist()
        cache = nanoserve.adapters.last_cache(model).paged  # held by result
        seen["pool_shape"] = list(cache.key_pools[0].shape)
        seen["block_ids"] = [table.block_ids for table in cache.tables]
        del result, cache

        agree = capture_agreement(model)
        seen["agree_all"] = agree(True)
        seen["agree_one_fails"] = agree(rank != 0)
        state_of(model).graphs = DecodeGraphs(capture=False, agree=agree)
        seen["graph_runner"] = model.generate(input_ids=ids, attention_mask=mask, **greedy).tolist()
        seen["graph_replays"] = state_of(model).graphs.replays

        # EOS: the token row 0 chose at its 4th step, so rows finish at different steps and
        # nanoserve's decode loop drops finished rows from the batch on every rank alike
        eos = seen["paged"][0][ids.shape[1] + 3]
        with_eos = dict(greedy, eos_token_id=eos)
        seen["eos"] = eos
        seen["eos_paged"] = model.generate(input_ids=ids, attention_mask=mask, **with_eos).tolist()
        seen["eos_loop"] = nanoserve.decode_graph_stats(model)["decode_loop"]

        torch.manual_seed(11)
        seen["paged_sampled"] = model.generate(input_ids=ids[:1], **sampled).tolist()
        seen["sampled_loop"] = nanoserve.decode_graph_stats(model)["decode_loop"]
        seen["sampled_rows_shared"] = nanoserve.cache_stats(model)["rows_shared"]

        first, second = shared_prefix_prompts(vocab)
        seen["prefix_first"] = model.generate(input_ids=first, **greedy).tolist()
        seen["prefix_second"] = model.generate(input_ids=second, **greedy).tolist()
        seen["prefix_hits"] = nanoserve.cache_stats(model)["prefix_hits"]
        seen["again_second"] = model.generate(input_ids=second, **greedy).tolist()
        seen["again_hits"] = nanoserve.cache_stats(model)["prefix_hits"]
        if rank == 0:  # this rank alone drops its cached prefixes
            nanoserve.release_memory(model)
        seen["released_second"] = model.generate(input_ids=second, **greedy).tolist()
        seen["released_hits"] = nanoserve.cache_stats(model)["prefix_hits"]
        if rank == 0:  # this rank's shard alone changes, through .data: no new version
            weight = model.model.layers[0].mlp.down_proj.weight
            weight = weight.to_local() if hasattr(weight, "to_local") else weight
            weight.data[0, 0] += 1e-3
        seen["changed_second"] = model.generate(input_ids=second, **greedy).tolist()
        seen["changed_hits"] = nanoserve.cache_stats(model)["prefix_hits"]

        # ranks patched with other options (rank 0 shares no prefix) would run forwards of
        # other lengths into the collectives: every rank refuses the call instead
        nanoserve.patch_model(model, block_size=4, prefix_sharing=rank != 0)
        try:
            model.generate(input_ids=first, **greedy)
            seen["options_differ"] = "ran"
        except ValueError as error:
            seen["options_differ"] = str(error)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # (gloo's threads could abort the interpreter's own teardown natively, "terminate called
    # without an active exception", after the work was done and written: skip that teardown)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
