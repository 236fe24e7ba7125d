"""One rank of a two-process (gloo, CPU) tensor-parallel run for test_more_families: loads the
model folder with ``tp_plan="auto"``, generates greedily with stock's cache and then patched,
and rank 0 writes both sequences to the output file."""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import nanoserve


def main(folder: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    ids, mask = prompts(model.config.vocab_size)
    greedy = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    seen = {}
    with torch.no_grad():
        seen["stock"] = model.generate(input_ids=ids, attention_mask=mask, **greedy).tolist()
        nanoserve.patch_model(model, block_size=4)
        result = model.generate(
            input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **greedy
        )
        seen["paged"] = result.sequences.tolist()
        seen["pool_kv_heads"] = result.past_key_values.paged.key_pools[0].shape[2]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of 11 and 7 tokens (the same on every rank)."""
    ids = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # (gloo's threads could abort the interpreter's own teardown natively, "terminate called
    # without an active exception", after the work was done and written: skip that teardown)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
