"""Patched generate under transformers' tensor parallelism against one GPU, with CUDA graphs.

Run under torchrun, one process per GPU (NCCL) or, with --tiny, per CPU process (gloo):
    torchrun --nproc_per_node 2 benchmarks/bench_tensor_parallel.py [--tiny]
For each shape (random weights, bf16, saved once by rank 0 and loaded by every rank with
tp_plan="auto"; rank 0 also loads it alone on its own GPU):
- llama3-8b: Llama-3-8B (hidden 4096, 32 query / 8 KV heads, 32 layers);
- llama3-70b-slice: 8 of Llama-3-70B's 80 layers (hidden 8192, 64 / 8 heads, MLP 28672).
It times greedy generate at batch 1 (prompt 512) and on a left-padded ragged batch of 32
(prompts 128..1024), 128 new tokens each: tensor parallel with decode graphs, tensor parallel
eager (cuda_graphs=False) and one GPU with graphs; each the median of three calls after two
warm-up calls (``--profile`` also prints each graphs run's kernels by device time). Checks,
printed beside the table:
- replay against eager on each rank: the graph run's tokens and logits equal the eager run's
  bit for bit;
- float32 exactness (a 4-layer Llama-3-8B-shaped model): per-step logits of the tensor-parallel
  run, teacher-forced on one GPU's greedy tokens, against one GPU's (max |difference| and the
  logits' spread), and how many greedy tokens agree unforced;
- the all-reduce time of one decode step: the step's 2 x layers all-reduces of [rows, hidden]
  bf16, captured in one CUDA graph and replayed.
Multicast stays off (NCCL_NVLS_ENABLE=0): the shared hosts forbid it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_generate import left_padded  # noqa: E402
from harness import fresh_salt  # noqa: E402

import nanoserve  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama3-70b-slice": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=8,
                             num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=16),
}  # fmt: skip


def build_config(shape: str, layers: int | None = None):
    from transformers import LlamaConfig

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    vocab = 512 if shape == "tiny" else 128256
    return LlamaConfig(**fields, vocab_size=vocab, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip


def save_random_model(config, folder: str, dtype, device) -> None:
    """Rank 0 writes a random-weight model (built on ``device``: fast) to ``folder``."""
    from transformers import LlamaForCausalLM

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        model.save_pretrained(folder)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()


def load(folder: str, dtype, device, sharded: bool):
    from transformers import AutoModelForCausalLM, DistributedConfig

    if sharded:
        config = DistributedConfig(tp_plan="auto")
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, distributed_config=config
        ).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def batches(vocab: int, device, tiny: bool) -> dict[str, tuple]:
    ragged = [int(n) for n in torch.linspace(8 if tiny else 128, 64 if tiny else 1024, 32)]
    return {
        name: left_padded(lens, vocab, torch.Generator().manual_seed(7), device)
        for name, lens in (("batch 1", [32 if tiny else 512]), ("ragged 32", ragged))
    }


GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, ids, mask, new: int, device, calls: int = 3) -> tuple[torch.Tensor, dict]:
    """(new tokens, figures) of greedy calls after warm-up calls of the same shape: the
    median seconds of ``calls`` whole calls, the first token's (a call of one new token: the
    prefill), the decode step's milliseconds between them, and the graphs the timed calls
    captured. Two warm-up calls: the first stores the prompts' blocks, the second is the
    first to read them back; each compiles kernels of its own. Each timed call has a
    ``fresh_salt``: it prefills its prompts as a call with new prompts does."""
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **GREEDY)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, **GREEDY)
    sync(device)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, cache_salt=fresh_salt(),
                   **GREEDY)  # fmt: skip
    sync(device)
    first = time.perf_counter() - start
    captures = nanoserve.decode_graph_stats(model)["captures"]
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, cache_salt=fresh_salt(), **GREEDY)  # fmt: skip
        sync(device)
        seconds.append(time.perf_counter() - start)
    total = statistics.median(seconds)
    tokens = out[:, ids.shape[1] :]
    return tokens, dict(
        tok_s=tokens.numel() / total,
        first_ms=first * 1e3,
        step_ms=(total - first) / (new - 1) * 1e3,
        captures=nanoserve.decode_graph_stats(model)["captures"] - captures,
    )


def profile_call(model, ids, mask, new: int, label: str, log) -> None:
    """Print rank 0's kernels (on CPU: operators) of one greedy call by device time; every
    rank runs the call, only rank 0 profiles it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = ids.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiling = dist.get_rank() == 0
    with profile(activities=activities) if profiling else contextlib.nullcontext() as prof:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, cache_salt=fresh_salt(), **GREEDY)  # fmt: skip
        sync(ids.device)
    if not profiling:
        return

    def spent(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    say(f"{label}: {'kernels' if cuda else 'operators'} by time over {new} steps (rank 0)", log)
    for event in sorted(prof.key_averages(), key=spent, reverse=True)[:14]:
        say(f"  {spent(event) / 1e3:9.2f} ms  x{event.count:<6d} {event.key[:100]}", log)


def logits_of(model, ids, mask, new: int, forced=None):
    """(tokens, per-step logits [steps, rows, vocab] float32) of a greedy call; ``forced``
    [rows, new] makes it choose those tokens instead (teacher forcing)."""
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([_Force(forced)] if forced is not None else [])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=new, output_logits=True, return_dict_in_generate=True,
                         logits_processor=processors, **GREEDY)  # fmt: skip
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits).float()


class _Force:
    """A logits processor that picks the given token of each step (teacher forcing)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.tokens[:, self.step : self.step + 1], 0.0)
        self.step += 1
        return forced


def allreduce_step_us(rows: int, hidden: int, layers: int, dtype, device) -> float:
    """Microseconds of one decode step's all-reduces (2 per layer), replayed as a graph."""
    x = torch.zeros(rows, hidden, dtype=dtype, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(2 * layers):
            dist.all_reduce(x)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, reps = time.perf_counter(), 50
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def say(text: str, log) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)
        if log is not None:
            log.write(text + "\n")
            log.flush()


def speed(shape: str, args, device, dtype, log) -> list[dict]:
    folder = os.path.join(args.folder, shape)
    config = build_config(shape)
    save_random_model(config, folder, dtype, device)
    rows = []
    sharded = load(folder, dtype, device, sharded=True)
    data = batches(config.vocab_size, device, args.tiny)
    results = {}
    runs = {"graphs": dict(cuda_graphs=True), "graphs, HF's loop": dict(decode_loop=False)}
    if not args.quick:
        runs["eager"] = dict(cuda_graphs=False)
    for run, options in runs.items():
        nanoserve.patch_model(sharded, **options)
        for name, (ids, mask) in data.items():
            tokens, figures = timed_generate(sharded, ids, mask, args.new_tokens, device)
            results[(name, run)] = tokens
            if args.profile and run == "graphs":
                profile_call(sharded, ids, mask, args.new_tokens, f"{shape} {name} TP", log)
            loop = nanoserve.decode_graph_stats(sharded)["decode_loop"]
            rows.append(dict(shape=shape, batch=name, run=f"TP x{dist.get_world_size()} {run}",
                             loop=loop, **figures))  # fmt: skip
    for name in data:
        same = all(torch.equal(results[(name, "graphs")], results[(name, r)]) for r in runs)
        say(f"{shape} {name}: TP tokens equal across {', '.join(runs)}: {same}", log)
    # replay against eager, bit for bit, logits included (each rank checks its own)
    ids, mask = data["ragged 32"]
    nanoserve.patch_model(sharded, cuda_graphs=device.type == "cuda")
    replay_tokens, replay_logits = logits_of(sharded, ids, mask, 16)
    say(f"{shape}: TP decode graph stats {nanoserve.decode_graph_stats(sharded)}", log)
    nanoserve.patch_model(sharded, cuda_graphs=False)
    eager_tokens, eager_logits = logits_of(sharded, ids, mask, 16)
    bitwise = torch.equal(replay_tokens, eager_tokens) and torch.equal(replay_logits, eager_logits)
    verdict = torch.tensor([int(bitwise)], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    say(f"{shape}: graph replay equals eager bit for bit (tokens and logits, every rank): "
        f"{bool(verdict.item())}", log)  # fmt: skip
    del sharded
    torch.cuda.empty_cache() if device.type == "cuda" else None
    dist.barrier()
    if dist.get_rank() == 0:
        alone = load(folder, dtype, device, sharded=False)
        nanoserve.patch_model(alone, cuda_graphs=device.type == "cuda")
        for name, (ids, mask) in data.items():
            tokens, figures = timed_generate(alone, ids, mask, args.new_tokens, device)
            loop = nanoserve.decode_graph_stats(alone)["decode_loop"]
            rows.append(dict(shape=shape, batch=name, run="one GPU graphs", loop=loop, **figures))
            if args.profile:
                profile_call(alone, ids, mask, args.new_tokens, f"{shape} {name} one GPU", log)
            same = (tokens == results[(name, "graphs")]).float().mean().item()
            say(f"{shape} {name}: bf16 greedy tokens equal to one GPU's: {same:.1%}", log)
        del alone
        torch.cuda.empty_cache() if device.type == "cuda" else None
    dist.barrier()
    if device.type == "cuda":
        for batch_rows in (1, 32):
            us = allreduce_step_us(batch_rows, config.hidden_size,
                                   config.num_hidden_layers, dtype, device)  # fmt: skip
            say(f"{shape}: all-reduces of one decode step, {batch_rows} rows: {us:.0f} us", log)
    return rows


def exactness(args, device, log) -> None:
    """float32: teacher-forced per-step logits, tensor parallel against one GPU."""
    shape = "tiny" if args.tiny else "llama3-8b"
    folder = os.path.join(args.folder, shape + "-fp32")
    config = build_config(shape, layers=None if args.tiny else 4)
    save_random_model(config, folder, torch.float32, device)
    ids, mask = batches(config.vocab_size, device, args.tiny)["ragged 32"]
    new = 32
    forced = torch.zeros(ids.shape[0], new, dtype=torch.long, device=device)
    if dist.get_rank() == 0:
        alone = nanoserve.patch_model(load(folder, torch.float32, device, sharded=False))
        alone_tokens, alone_logits = logits_of(alone, ids, mask, new)
        forced.copy_(alone_tokens)
        del alone
    dist.broadcast(forced, src=0)
    sharded = nanoserve.patch_model(load(folder, torch.float32, device, sharded=True))
    free_tokens, _ = logits_of(sharded, ids, mask, new)
    _, tp_logits = logits_of(sharded, ids, mask, new, forced=forced)
    if dist.get_rank() == 0:
        diff = (tp_logits - alone_logits).abs().max().item()
        spread = alone_logits.std().item()
        agree = (free_tokens == alone_tokens).float().mean().item()
        say(f"float32 4-layer {shape}: teacher-forced per-step logits max |TP - one GPU| "
            f"{diff:.2e} (logits std {spread:.3f}); unforced greedy tokens equal: {agree:.1%}",
            log)  # fmt: skip
    del sharded
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU processes (gloo), tiny model")
    parser.add_argument("--shapes", nargs="*", default=["llama3-70b-slice", "llama3-8b"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "nanoserve_tp"))
    parser.add_argument("--quick", action="store_true",
                        help="skip the float32 check and the eager runs")  # fmt: skip
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print the kernels of one graphs call per batch by device time",
    )
    parser.add_argument("--report", default=None, help="also write the report to this file")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    log = open(args.report, "w") if args.report and dist.get_rank() == 0 else None  # noqa: SIM115
    import transformers

    backend = "nccl" if cuda else "gloo"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    say(f"world {dist.get_world_size()} ({backend}), {versions}", log)
    if not args.quick:
        exactness(args, device, log)
    rows = []
    for shape in ["tiny"] if args.tiny else args.shapes:
        rows += speed(shape, args, device, dtype, log)
    if dist.get_rank() == 0:
        say("| shape | batch | run | loop | tok/s (call) | first token ms | decode ms/step | "
            "captures in timed call |", log)  # fmt: skip
        say("|---|---|---|---|---|---|---|---|", log)
        for r in rows:
            say(f"| {r['shape']} | {r['batch']} | {r['run']} | {r['loop']} | {r['tok_s']:,.0f} "
                f"| {r['first_ms']:.1f} | {r['step_ms']:.2f} | {r['captures']} |", log)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
