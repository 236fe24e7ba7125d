"""Patched generation under transformers' tensor parallelism: two gloo processes on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import nanoserve

WORKER = Path(__file__).with_name("tp_worker.py")
# vocab_size divides among the 2 ranks: transformers 5.17 shards the embedding evenly
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=104, max_position_embeddings=256)  # fmt: skip


def test_tensor_parallel_generate_equals_one_process(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2"]  # fmt: skip
    cmd = [*launcher, str(WORKER), str(tmp_path / "model"), str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    gen = torch.Generator().manual_seed(3)  # the worker's batch, in one process
    ids = torch.randint(3, CONFIG["vocab_size"], (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    opts = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        one_process = model.generate(input_ids=ids, attention_mask=mask, **opts).tolist()
    for rank in ranks:
        assert rank["world"] == 2
        assert rank["stock"] == one_process  # the sharded stock model agrees with one process
        assert rank["paged"] == one_process
        assert rank["pool_shape"][2] == CONFIG["num_key_value_heads"] // 2  # a shard of heads
    assert ranks[0]["block_ids"] == ranks[1]["block_ids"]  # same decisions, no communication


def test_kv_heads_that_do_not_divide_among_ranks_raise():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model._tp_size = 4  # as a tp_plan model over 4 ranks records it
    with pytest.raises(ValueError, match="2 KV heads do not divide among 4"):
        nanoserve.patch_model(model)
    assert model.config._attn_implementation != "nanoserve_paged"
