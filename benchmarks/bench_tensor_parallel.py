"""Patched generate under transformers' tensor parallelism against one process.

Run under torchrun, one process per GPU (NCCL) or, with --tiny, per CPU process (gloo):
    torchrun --nproc_per_node 2 benchmarks/bench_tensor_parallel.py [--tiny]
A random-weight Llama-3-8B-shaped model (hidden 4096, 32 query / 8 KV heads, head_dim 128,
--layers of them, default 8) in bf16 is saved once by rank 0, loaded by every rank with
tp_plan="auto", patched, and asked for greedy tokens on a left-padded batch of 32 prompts
(128..1024 tokens, 128 new). Rank 0 then loads the same folder alone on its own device and
does the same. It prints whether the tokens agree and both decode rates (tokens/s).
Multicast stays off (NCCL_NVLS_ENABLE=0): the shared hosts forbid it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nanoserve  # noqa: E402


def build_config(tiny: bool, layers: int):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                           max_position_embeddings=2048)  # fmt: skip
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0)  # fmt: skip


def batch(vocab: int, rows: int, device):
    gen = torch.Generator().manual_seed(7)
    lens = [int(n) for n in torch.linspace(128, 1024, rows)]
    width = max(lens)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lens):
        ids[row, width - n :] = torch.randint(2, vocab, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def timed_generate(model, ids, mask, new: int, device) -> tuple[torch.Tensor, float]:
    opts = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **opts)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=new, **opts)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out[:, ids.shape[1] :], time.perf_counter() - start


def main() -> None:
    from transformers import AutoModelForCausalLM, DistributedConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "nanoserve_tp"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if rank == 0:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(build_config(args.tiny, args.layers)).to(dtype).save_pretrained(
            args.folder
        )
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(
        args.folder, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    nanoserve.patch_model(model)
    ids, mask = batch(model.config.vocab_size, args.rows, device)
    sharded, secs = timed_generate(model, ids, mask, args.new_tokens, device)
    rate = sharded.numel() / secs
    dist.barrier()
    if rank == 0:
        alone = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype).to(device).eval()
        nanoserve.patch_model(alone)
        single, single_secs = timed_generate(alone, ids, mask, args.new_tokens, device)
        same = (single == sharded).float().mean().item()
        print(f"world {world} ({'nccl' if cuda else 'gloo'}), {args.rows} rows x "
              f"{args.new_tokens} new tokens: tensor parallel {rate:.0f} tok/s, one device "
              f"{single.numel() / single_secs:.0f} tok/s; tokens equal: {same:.1%}")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
