"""One rank of the tensor-parallel test (run by torchrun from test_tensor_parallel.py).

Loads the saved model with transformers' tensor parallelism (gloo on CPU), generates greedily
on a left-padded batch stock and patched, and writes what it saw to ``OUT/rank<r>.json``.
Usage: torchrun --nproc_per_node N tp_worker.py MODEL_FOLDER OUT_FOLDER
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import nanoserve


def main(folder: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    opts = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        stock = model.generate(input_ids=ids, attention_mask=mask, **opts)
        nanoserve.patch_model(model, block_size=4)
        result = model.generate(
            input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **opts
        )
        paged = result.sequences
        cache = nanoserve.adapters.last_cache(model).paged  # held by result
    result = dict(
        rank=rank,
        world=dist.get_world_size(),
        stock=stock.tolist(),
        paged=paged.tolist(),
        pool_shape=list(cache.key_pools[0].shape),
        block_ids=[table.block_ids for table in cache.tables],
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
