"""End to end: stock transformers `generate` against the patched model, on the GPU.

A random-weight Llama-3.2-1B-shaped model (16 layers, hidden 2048, 32 query / 8 KV heads,
head_dim 64, vocab 128256) in bf16, greedy, EOS off, 256 new tokens; batch 1 with a 512-token
prompt, and a ragged batch of 32 prompts of lengths spread evenly over 128..2048 (left padded).
Providers: stock default (sdpa, DynamicCache), stock static cache (auto torch.compile), HF's
own paged mode (`generate_batch`), and nanoserve's patched model, eager, with decode steps
replayed as CUDA graphs, and with graphs over torch.compile'd decoder layers
(`compile_decode=True`). The static cache and the patched model are timed after warm-up calls
of the timed length (so the pool, the graphs and the compiles are made before timing), as the
median of three calls; the slow providers once. Each timed call of a patched model has
a fresh ``cache_salt`` (``harness.fresh_salt``): it finds none of the blocks earlier calls
stored and prefills its prompts as stock does (except ``--system-prompt``, which measures the
reuse). Columns: tokens/s, peak GPU memory, KV
bytes reserved against KV bytes the tokens need, and how many generated tokens equal stock
default's.

Usage: python3 benchmarks/bench_generate.py [--new-tokens 256] [--tiny] [--only a,b]
    [--capacity [--prefill-chunk 256] [--kv-dtype fp8_e4m3]] [--stream 50]
Provider ``nanoserve_graphs_fp8`` is the patched model with FP8 pools
(``kv_dtype="fp8_e4m3"``); ``--capacity --kv-dtype fp8_e4m3`` fills the 40 GiB pool with FP8
blocks (twice the rows of bf16's).
`--stream N` runs N patched generate calls of random sizes (batch 1..32, prompts 16..1024,
64 new tokens) with the default pool policy (a kept pool serves every call that fits) and
with ``keep_pools=False`` (a new pool, so new graphs, every call): seconds per call, capture
time included, captures, and the memory held between calls.
`--group` runs the group rollout of RL trainers: 16 prompts of 256..2048 tokens, each 8 times
in one left-padded batch of 128 rows, 256 sampled new tokens (top_k 50), nanoserve with and
without prefix sharing beside the static cache + compile; time to first token is the same
call with one new token.
`--system-prompt` runs 32 calls of batch 4 that share one 2,048-token system prompt and add
64-token user turns, one new token each, with and without prefix sharing: the whole call and
its prefill (the first forward, bracketed by synchronizes) timed, the median of the later
calls and of three first calls on system prompts of their own (those that captured no CUDA
graph: a capture runs the step eagerly besides recording it), the GPU kernel time and
launches of a later call and of a first one (torch.profiler, a first call that replays), and
the ratio the two calls' matrix work allows at equal FLOP/s (``forward_flops``). Warm-ups on
other system prompts pay the compiles, autotunes and captures of every shape first.
`--eos-spread` runs 64 sampled rows (top_k 50) of one 512-token prompt whose EOS arrives
spread over 32..512 new tokens (min_new_tokens 32, max_new_tokens 512; EOS made likely by
scaling its output-embedding row, calibrated once so the median row ends near 128 new
tokens; the same model for every provider): nanoserve with its own decode loop, with HF's
loop (``decode_loop=False``), and the static cache + compile. Useful tokens/s counts each
row's tokens up to its EOS.
`--step-profile` profiles batch 1 (prompt 512, 256 greedy tokens) under torch.profiler for
nanoserve's own loop and HF's loop: per decode step, the GPU kernel time, the host time
spent waiting on the device (event / stream synchronizes) and the host's busy time (wall
less the waits), and the kernels launched per step.
`--tiny` runs a 2-layer model on whatever device there is (a smoke test, not a benchmark).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import WARM_UP_CALLS, fresh_salt, print_table, write_csv  # noqa: E402
from plot import plot_rows  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.kernels.small_batch_linear import MAX_ROWS  # noqa: E402

GIB = 2**30
# the fast providers (static cache, patched) are timed as the median of this many calls
TIMED_CALLS = 3
# unprofiled first calls --system-prompt runs at most before profiling one (see
# warm_first_call_kernels)
FIRST_CALL_TRIES = 3
# first calls --system-prompt times on system prompts of their own
FIRST_CALLS_TIMED = 3


def build_model(tiny: bool, device: str):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                             max_position_embeddings=4096)  # fmt: skip
    else:
        config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             vocab_size=128256, max_position_embeddings=8192,
                             rope_theta=500000.0, tie_word_embeddings=True)  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None,
                                               pad_token_id=0, bos_token_id=1)  # fmt: skip
    return model


def make_batches(tiny: bool, device: str, vocab: int) -> dict[str, tuple]:
    """name -> (input_ids, attention_mask, prompt lengths), left padded."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"batch1_prompt512": [512], "ragged32_128to2048": torch.linspace(128, 2048, 32)}
    if tiny:
        shapes = {"batch1_prompt32": [32], "ragged4_8to40": torch.linspace(8, 40, 4)}
    batches = {}
    for name, lens in shapes.items():
        lens = [int(n) for n in lens]
        batches[name] = (*left_padded(lens, vocab, gen, device), lens)
    return batches


def left_padded(lens: list[int], vocab: int, gen: torch.Generator, device, low: int = 2):
    """(input_ids, attention_mask) [len(lens), max(lens)] int64 on ``device``: random token
    ids in low..vocab-1 drawn from ``gen`` row by row, each row left padded with id 0."""
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for row, n in enumerate(lens):
        ids[row, width - n :] = torch.randint(low, vocab, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


def kv_bytes_per_token(model, kv_dtype: str | None = None) -> int:
    """K/V bytes a token takes over all layers: in the model's dtype, or 1 byte an element
    with ``kv_dtype="fp8_e4m3"``."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = 1 if kv_dtype else next(model.parameters()).element_size()
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(model, ids, mask, new_tokens, device, **kwargs):
    """Generated tokens [B, new] and seconds."""
    sync(device)
    start = time.perf_counter()
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, **{**options, **kwargs})
    sync(device)
    return out[:, ids.shape[1] :], time.perf_counter() - start


def provider_stock(model, ids, mask, lens, new, device):
    out, secs = run_generate(model, ids, mask, new, device)
    reserved = ids.shape[0] * (ids.shape[1] + new) * kv_bytes_per_token(model)
    return out, secs, reserved


def timed(model, ids, mask, new, device, salted=False, **kwargs):
    """Generated tokens and the median seconds of TIMED_CALLS calls; ``salted`` (a patched
    model) gives each call a ``fresh_salt``, so none skips its prefill."""
    runs = [
        run_generate(model, ids, mask, new, device, **kwargs, **salt(salted))
        for _ in range(TIMED_CALLS)
    ]
    return runs[0][0], statistics.median(secs for _, secs in runs)


def salt(salted: bool) -> dict:
    """generate's ``cache_salt`` keyword with a ``fresh_salt`` when ``salted``, else none."""
    return {"cache_salt": fresh_salt()} if salted else {}


def provider_static(model, ids, mask, lens, new, device):
    run_generate(model, ids, mask, new, device, cache_implementation="static")  # compiles
    out, secs = timed(model, ids, mask, new, device, cache_implementation="static")
    reserved = ids.shape[0] * (ids.shape[1] + new) * kv_bytes_per_token(model)
    return out, secs, reserved


def provider_hf_paged(model, ids, mask, lens, new, device):
    # HF's paged mode takes unpadded prompts (it ignores attention_mask); give it the real ones
    prompts = [row[-n:].tolist() for row, n in zip(ids, lens, strict=True)]
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    sync(device)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg)
    sync(device)
    secs = time.perf_counter() - start
    ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).split("_")[-1]))
    out = torch.tensor([list(r.generated_tokens)[:new] for r in ordered], device=ids.device)
    return out, secs, None


def warm_up(model, ids, mask, new, device) -> None:
    """Untimed salted calls of a patched model on the timed calls' prompts and length: Triton
    compiles and the extend kernel autotunes here; the kept pool grows to the timed calls'
    size (a grown pool drops the graphs captured over the old one); each prefills, and the
    prefill's extend graph is captured at its second call over that pool."""
    for _ in range(WARM_UP_CALLS + 1):
        run_generate(model, ids, mask, new, device, **salt(True))


def provider_patched(model, ids, mask, lens, new, device, **patch_kwargs):
    nanoserve.patch_model(model, **patch_kwargs)
    try:
        warm_up(model, ids, mask, new, device)
        out, secs = timed(model, ids, mask, new, device, salted=True)
        stats = nanoserve.cache_stats(model)
        graphs = nanoserve.decode_graph_stats(model)
        if patch_kwargs.get("cuda_graphs") and graphs["disabled"]:
            raise RuntimeError(f"graphs disabled: {graphs['disabled']}")
        check_loop(graphs, patch_kwargs.get("decode_loop", True))
        fuse = patch_kwargs.get("fuse_decode", True) and patch_kwargs.get("cuda_graphs")
        check_fused(graphs, fuse and device == "cuda", ids.shape[0])
    finally:
        nanoserve.unpatch_model(model)
    return out, secs, stats["bytes_reserved"]


def provider_no_pdl(model, ids, mask, lens, new, device):
    """The default graphs with every kernel launched without programmatic dependent launch
    (``NANOSERVE_PDL=0``): the A/B of the launches' overlap."""
    before = os.environ.get("NANOSERVE_PDL")
    os.environ["NANOSERVE_PDL"] = "0"
    try:
        return provider_patched(model, ids, mask, lens, new, device, cuda_graphs=True)
    finally:
        if before is None:
            del os.environ["NANOSERVE_PDL"]
        else:
            os.environ["NANOSERVE_PDL"] = before


def check_fused(graphs: dict, fuse: bool, rows: int) -> None:
    """RuntimeError unless the norms ran fused exactly when ``fuse`` and the projections
    too when at most MAX_ROWS rows did."""
    fused = graphs["fused_decode"]
    if (fused["norm"] > 0) != fuse or (fused["attention"] > 0) != (fuse and rows <= MAX_ROWS):
        raise RuntimeError(f"fuse_decode={fuse} at {rows} rows, but ran {fused}")


def check_loop(graphs: dict, decode_loop: bool) -> None:
    """RuntimeError when the patched call did not run the decode loop it was meant to."""
    ran = graphs["decode_loop"]
    if decode_loop and ran != "nanoserve":
        raise RuntimeError(f"nanoserve's decode loop did not run: {ran}")
    if not decode_loop and ran != "stock: decode_loop=False":
        raise RuntimeError(f"HF's loop was asked for, {ran} ran")


def capacity(
    model, new: int, device: str, budget: int, prefill_chunk: int, kv_dtype: str | None = None
) -> dict:
    """The largest ragged batch (prompts drawn uniformly from 128..2048, + ``new`` tokens)
    whose blocks fit in ``budget`` bytes of paged KV, generated in one call with CUDA graphs,
    against the rows the static cache holds in the same bytes (every row reserved at
    2048 + ``new``, in the model's dtype). ``kv_dtype="fp8_e4m3"``: FP8 pools, so the
    budget holds twice the blocks of a bf16 model's. The prompts are prefilled in chunks of
    ``prefill_chunk`` columns (transformers' ``prefill_chunk_size``): a padded prefill of
    ~960 x 2048 tokens needs more activation memory than the card has beside the pool."""
    per_token = kv_bytes_per_token(model, kv_dtype)
    block_size = 16
    pool_blocks = budget // (block_size * per_token)
    gen = torch.Generator().manual_seed(2)
    drawn = [int(n) for n in torch.randint(128, 2049, (4 * pool_blocks // 80,), generator=gen)]
    lens, used = [], 0
    for n in drawn:  # the longest prefix of the draw whose blocks fit the pool
        blocks = -(-(n + new) // block_size)
        if used + blocks > pool_blocks:
            break
        lens.append(n)
        used += blocks
    else:
        raise RuntimeError("capacity: the draw ran out before the pool was full; draw more")
    if not lens:
        raise RuntimeError(f"capacity: {budget} bytes of KV hold no sequence of this workload")
    rows = len(lens)
    ids, mask = left_padded(lens, model.config.vocab_size, gen, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    nanoserve.patch_model(model, block_size=block_size, max_memory=budget, kv_dtype=kv_dtype)
    try:
        # warm-up: the extend kernel tunes and the decode graph of this bucket is captured
        run_generate(model, ids, mask, 2, device, prefill_chunk_size=prefill_chunk)
        out, secs = run_generate(model, ids, mask, new, device, prefill_chunk_size=prefill_chunk)
        stats = nanoserve.cache_stats(model)
        graphs = nanoserve.decode_graph_stats(model)
    finally:
        nanoserve.unpatch_model(model)
    static_rows = budget // ((2048 + new) * kv_bytes_per_token(model))
    needed = sum(n + new for n in lens) * per_token
    provider = "nanoserve_graphs" + ("_fp8" if kv_dtype else "")
    row = dict(batch=f"capacity{rows}_128to2048", provider=provider,
               rows=rows, static_rows=static_rows, ratio=round(rows / static_rows, 3),
               **{"tok/s": round(out.numel() / secs, 1), "seconds": round(secs, 2),
                  "kv_reserved_GiB": round(stats["bytes_reserved"] / GIB, 3),
                  "kv_used_GiB": round(stats["blocks_used"] * block_size * per_token / GIB, 3),
                  "kv_needed_GiB": round(needed / GIB, 3),
                  "graph_replays": graphs["replays"]})  # fmt: skip
    if device == "cuda":
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    print(f"capacity in {budget / GIB:.2f} GiB of KV (prompts 128..2048 + {new}): static cache "
          f"{static_rows} rows (each reserved at 2048 + {new}); paged {rows} rows "
          f"({stats['blocks_used']} of {stats['num_blocks']} blocks), ratio "
          f"{rows / static_rows:.2f}x; generated {out.numel()} tokens at "
          f"{out.numel() / secs:.0f} tok/s on {device} (prefill in chunks of "
          f"{prefill_chunk}; graphs {graphs})", flush=True)  # fmt: skip
    return row


PROVIDERS = {
    "stock_default": provider_stock,
    "nanoserve_graphs": functools.partial(provider_patched, cuda_graphs=True),
    "nanoserve_graphs_no_pdl": provider_no_pdl,
    "nanoserve_graphs_compiled": functools.partial(
        provider_patched, cuda_graphs=True, compile_decode=True
    ),
    "nanoserve_graphs_unfused": functools.partial(
        provider_patched, cuda_graphs=True, fuse_decode=False
    ),
    "nanoserve_graphs_compiled_unfused": functools.partial(
        provider_patched, cuda_graphs=True, compile_decode=True, fuse_decode=False
    ),
    "nanoserve_graphs_hf_loop": functools.partial(
        provider_patched, cuda_graphs=True, decode_loop=False
    ),
    "nanoserve_eager": functools.partial(provider_patched, cuda_graphs=False),
    "nanoserve_graphs_fp8": functools.partial(
        provider_patched, cuda_graphs=True, kv_dtype="fp8_e4m3"
    ),
    "stock_static_compile": provider_static,
    "hf_generate_batch": provider_hf_paged,
}


def stream(model, device: str, calls: int, tiny: bool) -> list[dict]:
    """Rows: one per pool policy over the same ``calls`` random generate calls."""
    rng = torch.Generator().manual_seed(5)
    shapes = []
    for _ in range(calls):
        batch = int(torch.randint(1, 5 if tiny else 33, (1,), generator=rng))
        lens = torch.randint(16, 64 if tiny else 1025, (batch,), generator=rng).tolist()
        shapes.append(left_padded(lens, model.config.vocab_size, rng, device))
    # Triton's compiles and the extend autotune happen once per process: pay them first, so
    # neither policy's figures carry them
    nanoserve.patch_model(model, keep_pools=False)
    for ids, mask in shapes:
        run_generate(model, ids, mask, 2, device)
    nanoserve.unpatch_model(model)
    rows = []
    for name, keep in (("kept pool (default)", True), ("keep_pools=False", False)):
        nanoserve.patch_model(model, keep_pools=keep)
        seconds, held = [], []
        try:
            for ids, mask in shapes:
                _, secs = run_generate(model, ids, mask, 64, device)
                seconds.append(secs)
                if device == "cuda":
                    held.append(torch.cuda.memory_allocated() / GIB)
            captures = nanoserve.decode_graph_stats(model)["captures"]
        finally:
            nanoserve.release_memory(model)
            nanoserve.unpatch_model(model)
        row = {"policy": name, "calls": calls, "total_s": round(sum(seconds), 2),
               "median_s": round(statistics.median(seconds), 3),
               "max_s": round(max(seconds), 3), "captures": captures}  # fmt: skip
        if held:
            row["held_GiB_min"], row["held_GiB_max"] = round(min(held), 3), round(max(held), 3)
        rows.append(row)
        print(row, flush=True)
    return rows


def group_rollout(model, device: str, tiny: bool) -> list[dict]:
    """Rows: tokens/s, time to first token, peak memory and KV reserved per provider."""
    gen = torch.Generator().manual_seed(3)
    prompts, copies = (4, 2) if tiny else (16, 8)
    lens = [int(n) for n in torch.linspace(16 if tiny else 256, 48 if tiny else 2048, prompts)]
    ids, mask = left_padded(lens, model.config.vocab_size, gen, device)
    ids, mask = ids.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0)
    new = 16 if tiny else 256
    unique = (sum(lens) + len(lens) * copies * new) * kv_bytes_per_token(model)
    sample = dict(do_sample=True, top_k=50)
    providers = {
        "nanoserve, prefix sharing": dict(prefix_sharing=True),
        "nanoserve, no sharing": dict(prefix_sharing=False),
        "stock static + compile": None,
    }
    rows = []
    for name, patch in providers.items():
        extra = dict(cache_implementation="static") if patch is None else {}
        if patch is not None:
            nanoserve.patch_model(model, **patch)
        try:
            run_generate(model, ids, mask, new, device, **sample, **extra)  # warm-up, compile
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            calls = 1 if patch is None else TIMED_CALLS
            salted = patch is not None  # rows share a prompt within a call, not across calls
            seconds = statistics.median(
                run_generate(model, ids, mask, new, device, **sample, **extra, **salt(salted))[1]
                for _ in range(calls)
            )
            row = {"provider": name, "tok/s": round(ids.shape[0] * new / seconds, 1),
                   "seconds": round(seconds, 2)}  # fmt: skip
            if device == "cuda":
                row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            if patch is not None:
                stats = nanoserve.cache_stats(model)
                row["kv_reserved/unique"] = round(stats["bytes_reserved"] / unique, 3)
                row["rows_shared"] = stats["rows_shared"]
            ttft = statistics.median(
                run_generate(model, ids, mask, 1, device, **sample, **extra, **salt(salted))[1]
                for _ in range(calls)
            )
            row["first_token_s"] = round(ttft, 3)
        finally:
            if patch is not None:
                nanoserve.release_memory(model)
                nanoserve.unpatch_model(model)
        rows.append(row)
        print(row, flush=True)
    return rows


class PrefillTimer:
    """Seconds of the first forward of each armed generate call (the prefill: nanoserve's
    lookup and setup and every forward it runs), bracketed by device synchronizes, from a
    forward pre-hook and hook on the model (registered once: the prefix salt names hooks by
    handle, so later calls still find the stored prompt; a wrapper set on ``model.forward``
    would be read with the state it holds, which changes every call, and no prompt stored
    by one call would be found by the next). ``unpatch_model`` leaves the hooks on the
    model; ``remove()`` takes them off."""

    def __init__(self, model, device: str):
        self.device, self.seconds, self.armed, self.start = device, [], False, None

        def before(module, args):
            if self.armed:
                sync(device)
                self.start = time.perf_counter()

        def after(module, args, output):
            if self.armed:
                self.armed = False
                sync(device)
                self.seconds.append(time.perf_counter() - self.start)

        self.handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def call(self, model, ids, mask) -> float:
        """Seconds of one generate call with one new token (its prefill timed alone)."""
        self.armed = True
        return run_generate(model, ids, mask, 1, self.device)[1]


def prefill_kernels(model, ids, mask, device: str) -> tuple[float, float, int]:
    """(summed GPU kernel ms, the part of it in the prefix salt's weight hash, kernels
    launched) of one generate call with one new token under torch.profiler: what a replayed
    CUDA graph of the prefill would take at best."""
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return float("nan"), float("nan"), 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_generate(model, ids, mask, 1, device)
    events = prof.key_averages()  # as step_profile counts them
    hashing = [e for e in events if "_hash_kernel" in e.key]
    return kernel_seconds(events) * 1e3, kernel_seconds(hashing) * 1e3, kernel_launches(events)


def kernel_seconds(events) -> float:
    """Seconds of GPU kernels in a profile's ``key_averages()``: device events only (an
    eager op's own entry repeats the time of the kernels it launched)."""
    device = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in events if e.device_type == device) / 1e6


def kernel_launches(events) -> int:
    """Kernel and graph launches the host made, from a profile's ``key_averages()``."""
    calls = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
    return sum(e.count for e in events if e.key in calls)


def captures(model) -> int:
    """CUDA graphs the patched model has captured so far (decode and extend)."""
    return nanoserve.decode_graph_stats(model)["captures"]


def warm_first_call_kernels(model, calls: list, device: str) -> tuple[float, float, int]:
    """``prefill_kernels`` of a first call (a system prompt no call stored) whose steps are
    replayed, not captured: a capture runs the step eagerly besides recording it, which the
    profile would count as the first call's work. First calls run unprofiled until one
    captures nothing (at most ``FIRST_CALL_TRIES``), then the next is profiled; returns its
    figures and the graphs captured during it (0 unless the tries ran out)."""
    *tries, profiled = calls
    for ids, mask in tries:
        before = captures(model)
        run_generate(model, ids, mask, 1, device)
        if captures(model) == before:
            break
    before = captures(model)
    gpu_ms, hash_ms, _ = prefill_kernels(model, *profiled, device)
    return gpu_ms, hash_ms, captures(model) - before


def forward_flops(config, steps: list[tuple[int, int, int]]) -> float:
    """Matrix FLOPs of a Llama-shaped ``config``'s forwards (gated MLP, no biases counted):
    ``steps`` of (rows, new tokens a row, tokens before them a row); causal attention of each
    new token over the tokens before it and itself; logits of each row's last token only
    (``logits_to_keep=1``, as generate's forwards ask)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    per_token = 2 * (
        hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * config.intermediate_size
    )
    total = 0.0
    for rows, new, before in steps:
        keys = new * before + new * (new + 1) // 2  # keys each new token attends, summed
        total += rows * layers * (new * per_token + 4 * heads * head_dim * keys)
        total += rows * 2 * hidden * config.vocab_size
    return total


def system_prompt_calls(model, device: str, tiny: bool) -> list[dict]:
    """Rows, per policy: whole-call and prefill seconds, medians of first calls (system
    prompts no call stored; those that captured nothing) and of the later ones, a later
    call's GPU kernel time and launches beside a first call's (their ratio without the salt's
    hash bounds what the prefill ratio can reach with no host time at all) and the ratio of
    their matrix work; a line after them says how far the later prefill is from the issue's
    goal (>= 10x faster than the first)."""
    gen = torch.Generator().manual_seed(6)
    system_len, user_len, calls = (40, 8, 6) if tiny else (2048, 64, 32)
    vocab = model.config.vocab_size

    def calls_over(n):
        system = torch.randint(2, vocab, (1, system_len), generator=gen).repeat(4, 1)
        out = []
        for _ in range(n):
            ids = torch.cat([system, torch.randint(2, vocab, (4, user_len), generator=gen)], 1)
            out.append((ids.to(device), torch.ones_like(ids).to(device)))
        return out

    # with sharing a first call computes the system prompt once, then each row's turn over it
    later_steps = [(4, user_len, system_len)]
    *batches, profiled = calls_over(calls + 1)  # profiled: new user turns, like a later call
    # Warm-up, unmeasured, on another system prompt of the same shapes: the Triton compiles
    # and extend autotunes of every shape the timed calls run (a full prefill of 4 rows; with
    # sharing the system prompt as a row of its own, then 4 short extends over it, first
    # after computing it and then over the cached blocks). The extend steps' CUDA graphs
    # live as long as the patch, and a bucket is captured the second time it comes: each
    # policy's timed calls follow warm-up calls of their own (``warm_again``; the first makes
    # the pool).
    warm = calls_over(3)
    # three system prompts, each a first call and a later one: the prefill's graphs of both
    # kinds captured before the timed calls (whose first is a first call too)
    warm_again = [call for _ in range(3) for call in calls_over(2)]
    # first calls: system prompts no call has stored, until one replays its prefill's graphs
    first_calls = [calls_over(1)[0] for _ in range(FIRST_CALL_TRIES + 1)]
    fresh_firsts = [calls_over(1)[0] for _ in range(FIRST_CALLS_TIMED)]
    for sharing in (False, True):
        nanoserve.patch_model(model, prefix_sharing=sharing)
        try:
            for ids, mask in warm:
                run_generate(model, ids, mask, 1, device)
        finally:
            nanoserve.release_memory(model)
            nanoserve.unpatch_model(model)
    rows = []
    for name, sharing in (("prefix sharing (default)", True), ("prefix_sharing=False", False)):
        nanoserve.patch_model(model, prefix_sharing=sharing)
        # the timer's hooks before the warm-ups: the model's hooks are part of the prefix
        # salt and of the graphs' key, so hooks added after them would drop the graphs and
        # the stored prompts the warm-ups made
        timer = PrefillTimer(model, device)
        try:
            for ids, mask in warm_again:
                run_generate(model, ids, mask, 1, device)
            before = captures(model)
            seconds = [timer.call(model, ids, mask) for ids, mask in batches]
            timed_captures = captures(model) - before
            prefill = list(timer.seconds)
            hits = nanoserve.cache_stats(model)["prefix_hits"]  # the last later call's
            # first calls timed apart, each on a system prompt of its own; those that captured
            # a graph (a capture runs the step eagerly too) are left out of the medians
            firsts = []
            for ids, mask in fresh_firsts:
                before = captures(model)
                call_s = timer.call(model, ids, mask)
                if captures(model) == before:
                    firsts.append((call_s, timer.seconds[-1]))
            gpu_ms, hash_ms, kernels = prefill_kernels(model, *profiled, device)
            first_ms, first_hash_ms, first_captures = warm_first_call_kernels(
                model, first_calls, device
            )
        finally:
            timer.remove()
            nanoserve.release_memory(model)
            nanoserve.unpatch_model(model)
        whole_rows = [(4, system_len + user_len, 0)]  # no sharing: every call prefills each row
        first_steps = [(1, system_len, 0), *later_steps] if sharing else whole_rows
        flop_ratio = forward_flops(model.config, first_steps) / forward_flops(
            model.config, later_steps if sharing else whole_rows
        )
        later, later_prefill = statistics.median(seconds[1:]), statistics.median(prefill[1:])
        first_s = statistics.median(c for c, _ in firsts) if firsts else float("nan")
        first_prefill = statistics.median(p for _, p in firsts) if firsts else float("nan")
        row = {"policy": name, "calls": calls, "first_call_s": round(first_s, 4),
               "later_median_s": round(later, 4), "first_prefill_ms": round(first_prefill * 1e3, 2),
               "later_prefill_ms": round(later_prefill * 1e3, 2),
               "first/later_prefill": round(first_prefill / later_prefill, 1),
               "first_calls_timed": len(firsts),
               "sequence_first_prefill_ms": round(prefill[0] * 1e3, 2),
               "later_gpu_kernel_ms": round(gpu_ms, 2), "later_kernels": kernels,
               "first_gpu_kernel_ms": round(first_ms, 2), "hash_ms": round(hash_ms, 2),
               "gpu_first/later_no_hash": round((first_ms - first_hash_ms) / (gpu_ms - hash_ms), 1),
               "flops_first/later": round(flop_ratio, 2), "hits_last_call": hits,
               "timed_captures": timed_captures,
               "first_profile_captures": first_captures}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    shared, unshared = rows
    full = unshared["later_prefill_ms"] / shared["later_prefill_ms"]
    print(
        f"goal (>= 10x): a later call's prefill is {shared['first/later_prefill']}x faster than "
        f"the first call's with sharing, {full:.1f}x faster than a full prefill without sharing "
        "(its later calls' median); at equal FLOP/s in both calls the ratio would be "
        f"{shared['flops_first/later']}x (the matrix work: a later call reads every weight for its "
        f"{4 * user_len} tokens, the first computes the system prompt once besides them)",
        flush=True,
    )
    return rows


def eos_lengths(out: torch.Tensor, eos: int) -> list[int]:
    """Each row's new tokens up to and including its first EOS (all of them without one)."""
    ends = (out == eos).int().argmax(dim=1)
    has = (out == eos).any(dim=1)
    return torch.where(has, ends + 1, out.shape[1]).tolist()


def eos_spread(model, device: str, tiny: bool, seeds: int = 4, only=()) -> list[dict]:
    """Rows: one per provider over 64 sampled rows whose EOS arrives spread over 32..512,
    each provider timed once on each of ``seeds`` seeds (``only``: the providers of these
    ``--only`` names: nanoserve_graphs, nanoserve_graphs_unfused, nanoserve_graphs_hf_loop,
    stock_static_compile; all when empty). In bf16 a compacted batch draws other
    tokens than HF's full one after its first compaction, so the rows' lengths differ between
    providers on one seed; summed over several seeds the work evens out (the table gives each
    provider's mean steps and mean longest row, to see how far)."""
    rows_n, prompt, low, high, eos = (8, 16, 4, 64, 2) if tiny else (64, 512, 32, 512, 2)
    gen = torch.Generator().manual_seed(8)
    ids, mask = left_padded([prompt], model.config.vocab_size, gen, device)
    ids, mask = ids.repeat(rows_n, 1), mask.repeat(rows_n, 1)
    sample = dict(do_sample=True, top_k=50, eos_token_id=eos, pad_token_id=0, min_new_tokens=low)

    def call(new, seed=0, **extra):
        if "cache_implementation" not in extra:  # a patched model: no stored prompt
            extra["cache_salt"] = fresh_salt()
        torch.manual_seed(11 + seed)
        sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             **sample, **extra)  # fmt: skip
        sync(device)
        return out[:, ids.shape[1] :], time.perf_counter() - start

    # calibrate the EOS row's scale (geometric bisection) so the median row ends near 4x low
    row = model.lm_head.weight[eos].detach().clone()
    nanoserve.patch_model(model)
    lo, hi, scale, lengths = 1.0, 4096.0, 1.0, []
    try:
        for _ in range(12):
            scale = (lo * hi) ** 0.5
            with torch.no_grad():
                model.lm_head.weight[eos] = row * scale
            lengths = eos_lengths(call(high)[0], eos)
            median = statistics.median(lengths)
            if 3 * low <= median <= 6 * low:
                break
            lo, hi = (scale, hi) if median > 6 * low else (lo, scale)
    finally:
        nanoserve.release_memory(model)
        nanoserve.unpatch_model(model)
    print(f"EOS row scaled by {scale:.3g}: new tokens per row min {min(lengths)}, median "
          f"{statistics.median(lengths)}, max {max(lengths)}", flush=True)  # fmt: skip
    providers = {
        "nanoserve, own decode loop": ("nanoserve_graphs", dict(decode_loop=True)),
        "nanoserve, own decode loop, unfused projections": (
            "nanoserve_graphs_unfused",
            dict(decode_loop=True, fuse_decode=False),
        ),
        "nanoserve, HF's loop": ("nanoserve_graphs_hf_loop", dict(decode_loop=False)),
        "stock static + compile": ("stock_static_compile", None),
    }
    results = []
    for name, (short, patch) in providers.items():
        if only and short not in only:
            continue
        extra = dict(cache_implementation="static") if patch is None else {}
        if patch is not None:
            nanoserve.patch_model(model, **patch)
        try:
            call(high, **extra)  # warm-up: compiles, captures
            runs = [call(high, seed, **extra) for seed in range(seeds)]
            if patch is not None:
                check_loop(nanoserve.decode_graph_stats(model), patch["decode_loop"])
        finally:
            if patch is not None:
                nanoserve.release_memory(model)
                nanoserve.unpatch_model(model)
        each = [eos_lengths(out, eos) for out, _ in runs]
        every = [n for lengths in each for n in lengths]
        seconds = sum(secs for _, secs in runs)
        result = {"provider": name, "useful_tok/s": round(sum(every) / seconds, 1),
                  "seconds": round(seconds, 3), "seeds": seeds,
                  "steps_mean": round(statistics.mean(out.shape[1] for out, _ in runs), 1),
                  "longest_mean": round(statistics.mean(max(n) for n in each), 1),
                  "len_min": min(every), "len_median": statistics.median(every),
                  "eos_scale": round(scale, 3)}  # fmt: skip
        results.append(result)
        print(result, flush=True)
    with torch.no_grad():
        model.lm_head.weight[eos] = row
    return results


def step_profile(model, device: str, tiny: bool) -> list[dict]:
    """Rows: per-step GPU time, host busy and waiting time, launches, for both loops."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask, _ = make_batches(tiny, device, model.config.vocab_size)[
        "batch1_prompt32" if tiny else "batch1_prompt512"
    ]
    new = 32 if tiny else 256
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rows = []
    variants = (
        ("nanoserve, own decode loop", True, True),
        ("nanoserve, own decode loop, unfused projections", True, False),
        ("nanoserve, HF's loop", False, True),
    )
    for name, loop, fuse in variants:
        nanoserve.patch_model(model, decode_loop=loop, fuse_decode=fuse)
        try:
            run_generate(model, ids, mask, new, device)  # compiles, captures
            with profile(activities=activities) as prof:
                out, secs = run_generate(model, ids, mask, new, device, **salt(True))
            check_loop(nanoserve.decode_graph_stats(model), loop)
        finally:
            nanoserve.release_memory(model)
            nanoserve.unpatch_model(model)
        steps = out.shape[1]
        events = prof.key_averages()
        waits = sum(e.self_cpu_time_total for e in events if "Synchronize" in e.key) / 1e6
        gpu = kernel_seconds(events)
        launches = kernel_launches(events)
        row = {"loop": name, "tok/s": round(steps / secs, 1),
               "ms/step": round(secs / steps * 1e3, 3),
               "gpu_ms/step": round(gpu / steps * 1e3, 3),
               "host_busy_ms/step": round((secs - waits) / steps * 1e3, 3),
               "host_wait_ms/step": round(waits / steps * 1e3, 3),
               "launches/step": round(launches / steps, 1)}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    return rows


def report(rows: list[dict], columns: list[str], name: str) -> None:
    """Write ``rows`` to ``name``.csv and print them as a table (missing cells empty)."""
    rows = [{c: r.get(c, "") for c in columns} for r in rows]
    write_csv(rows, f"{name}.csv")
    print_table(rows, columns)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated provider names")
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="also run the largest ragged batch a 40 GiB paged pool holds",
    )
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="prefill_chunk_size of the capacity run")  # fmt: skip
    parser.add_argument("--kv-dtype", default=None, choices=["fp8_e4m3"],
                        help="the capacity run's pool dtype (default: the model's)")  # fmt: skip
    parser.add_argument("--stream", type=int, default=0, metavar="N",
                        help="only N calls of random sizes, under both pool policies")  # fmt: skip
    parser.add_argument("--system-prompt", action="store_true",
                        help="only 32 calls sharing a 2,048-token system prompt")  # fmt: skip
    parser.add_argument("--group", action="store_true",
                        help="only the group rollout (16 prompts x 8 rows, sampled)")  # fmt: skip
    parser.add_argument("--step-profile", action="store_true",
                        help="only batch 1 under the profiler, both loops")  # fmt: skip
    parser.add_argument("--eos-spread", action="store_true",
                        help="only 64 sampled rows ending over 32..512 tokens")  # fmt: skip
    parser.add_argument("--eos-seeds", type=int, default=4,
                        help="seeds each provider runs in --eos-spread")  # fmt: skip
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.tiny, device)
    if args.system_prompt:
        columns = ["policy", "calls", "first_call_s", "later_median_s", "first_prefill_ms",
                   "later_prefill_ms", "first/later_prefill", "first_calls_timed",
                   "sequence_first_prefill_ms", "later_gpu_kernel_ms",
                   "later_kernels", "first_gpu_kernel_ms", "hash_ms", "gpu_first/later_no_hash",
                   "flops_first/later", "hits_last_call", "timed_captures",
                   "first_profile_captures"]  # fmt: skip
        report(system_prompt_calls(model, device, args.tiny), columns, "generate_system_prompt")
        return
    if args.group:
        columns = ["provider", "tok/s", "seconds", "first_token_s", "peak_GiB",
                   "kv_reserved/unique", "rows_shared"]  # fmt: skip
        report(group_rollout(model, device, args.tiny), columns, "generate_group")
        return
    if args.step_profile:
        columns = ["loop", "tok/s", "ms/step", "gpu_ms/step", "host_busy_ms/step",
                   "host_wait_ms/step", "launches/step"]  # fmt: skip
        report(step_profile(model, device, args.tiny), columns, "generate_step_profile")
        return
    if args.eos_spread:
        columns = ["provider", "useful_tok/s", "seconds", "seeds", "steps_mean",
                   "longest_mean", "len_min", "len_median", "eos_scale"]  # fmt: skip
        only = [name for name in args.only.split(",") if name]
        rows = eos_spread(model, device, args.tiny, args.eos_seeds, only)
        report(rows, columns, "generate_eos_spread")
        return
    if args.stream:
        columns = ["policy", "calls", "total_s", "median_s", "max_s", "captures",
                   "held_GiB_min", "held_GiB_max"]  # fmt: skip
        report(stream(model, device, args.stream, args.tiny), columns, "generate_stream")
        return
    if args.capacity:
        budget = 2**22 if args.tiny else 40 * GIB
        row = capacity(model, args.new_tokens, device, budget, args.prefill_chunk, args.kv_dtype)
        write_csv([row], "capacity.csv")
    batches = make_batches(args.tiny, device, model.config.vocab_size)
    chosen = [p for p in PROVIDERS if not args.only or p in args.only.split(",")]
    per_token = kv_bytes_per_token(model)
    rows = []
    for batch_name, (ids, mask, lens) in batches.items():
        needed = sum(n + args.new_tokens for n in lens) * per_token
        baseline = None
        for name in chosen:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            row = dict(batch=batch_name, provider=name)
            try:
                out, secs, reserved = PROVIDERS[name](
                    model, ids, mask, lens, args.new_tokens, device
                )
            except Exception as e:  # a provider this transformers version lacks: say so, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                print(f"{batch_name} {name}: {row['error']}", file=sys.stderr)
                continue
            if baseline is None and name == "stock_default":
                baseline = out
            row["tok/s"] = round(out.numel() / secs, 1)
            row["seconds"] = round(secs, 2)
            if device == "cuda":
                row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            row["kv_needed_GiB"] = round(needed / GIB, 3)
            if reserved is not None:
                row["kv_reserved_GiB"] = round(reserved / GIB, 3)
                row["reserved/needed"] = round(reserved / needed, 3)
            if baseline is not None and out.shape == baseline.shape:
                row["same_tokens_as_stock"] = f"{(out == baseline).float().mean().item():.1%}"
            rows.append(row)
            print(row, flush=True)
    columns = ["batch", "provider", "tok/s", "seconds", "peak_GiB", "kv_needed_GiB",
               "kv_reserved_GiB", "reserved/needed", "same_tokens_as_stock", "error"]  # fmt: skip
    rows = [{c: r.get(c, "") for c in columns} for r in rows]
    write_csv(rows, "generate.csv")
    plot_rows([r for r in rows if r["tok/s"] != ""], x="batch", y="tok/s", name="generate.png",
              title="generate tokens/s, random Llama-3.2-1B shapes, bf16")  # fmt: skip
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
    )
    print_table(rows, columns)


if __name__ == "__main__":
    main()
