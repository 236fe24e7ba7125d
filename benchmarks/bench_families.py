"""Gemma 2 and Gemma 3 on the GPU: stock transformers `generate` against the patched model.

Random-weight models in bf16 with the real widths and fewer layers: Gemma-2-9B-shaped
(hidden 3584, 16 query / 8 KV heads, head_dim 256, softcap 50, window 4096, 8 of its 42
layers) and Gemma-3-12B-shaped (hidden 3840, 16 / 8 heads, head_dim 256, window 1024, five
local layers to one global, 12 of its 48 layers). Greedy, EOS off. ``--only phi3`` adds a
Phi-3-mini-4k-shaped model (every layer slides within 2047: nanoserve releases the blocks
that fall out of the window, ``blocks_dropped``), 8 of its 32 layers.

Speed (tokens/s): batch 1 with a 512-token prompt, and a ragged batch of 8 prompts spread over
128..2048 tokens (left padded), 128 new tokens each. Providers: stock default (HF's dynamic
cache, whose sliding layers keep only their window; eager attention for Gemma 2, as 5.24
runs it, sdpa for Gemma 3), stock static cache + torch.compile (batch 1 only unless
``--static-ragged``: each batch shape compiles anew), and nanoserve (decode graphs, its own
decode loop). Fast providers are timed after warm-up calls, the median of ``--calls``; each
timed nanoserve call has a fresh ``cache_salt``, so it prefills its prompts as stock does.

Memory: one prompt of 8k and of 32k tokens (prefill in chunks of 4096 for both, 8 new
tokens); the KV bytes each cache holds afterwards: the tensors of HF's cache, nanoserve's
``cache_stats`` (the pool reserved, the bytes holding tokens, the blocks in use). Gemma's
sliding and global layers have a pool each (layer groups): ``global_MiB`` / ``sliding_MiB``
are each pool's reserved bytes (on stock's rows: its cache's global and sliding layers'),
``vs_stock`` nanoserve's reserved bytes over HF's cache, ``vs_full_cache`` the bytes
holding tokens over what every layer holding every token takes.

Usage: python3 benchmarks/bench_families.py [--only gemma2,gemma3] [--new-tokens 128]
    [--calls 3] [--static-ragged] [--no-memory] [--no-speed] [--tiny]
``--tiny`` runs 2-layer narrow models on whatever device there is (a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import left_padded  # noqa: E402
from harness import WARM_UP_CALLS, fresh_salt, print_table, write_csv  # noqa: E402

import nanoserve  # noqa: E402

GIB, MIB = 2**30, 2**20
SHAPES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
        attn_implementation="eager",
    )),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024,
    )),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=32, sliding_window=2047,
        original_max_position_embeddings=40000,  # else prompts past 4096 run without a cache
    )),
}  # fmt: skip
TINY = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
            sliding_window=64)  # fmt: skip
PREFILL_CHUNK = 4096


def build_model(family: str, tiny: bool, device: str, max_len: int):
    import transformers

    config_name, model_name, dims = SHAPES[family]
    if tiny:
        dims = {**dims, **TINY}
    config = getattr(transformers, config_name)(
        **dims, max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_name)(config).to(dtype).eval()
    model.generation_config = transformers.GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=1
    )
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(model, ids, mask, new: int, device: str, **kwargs):
    """(generate's output, seconds)."""
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kwargs
        )
    sync(device)
    return out, time.perf_counter() - start


def timed(model, ids, mask, new: int, device: str, calls: int, salted=False, **kwargs):
    """New tokens [B, new] of the warm-up calls (``WARM_UP_CALLS``), and the median seconds
    of ``calls`` calls; ``salted`` (a patched model) gives each timed call a
    ``fresh_salt``, so none skips its prefill."""
    for _ in range(WARM_UP_CALLS):
        out, _ = run_generate(model, ids, mask, new, device, **kwargs)
    secs = []
    for _ in range(calls):
        salt = {"cache_salt": fresh_salt()} if salted else {}
        secs.append(run_generate(model, ids, mask, new, device, **kwargs, **salt)[1])
    return out[:, ids.shape[1] :], statistics.median(secs)


def speed_rows(model, family: str, device: str, args, tiny: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batches = {
        "batch1_prompt512": [64 if tiny else 512],
        "ragged8_128to2048": [int(n) for n in torch.linspace(16 if tiny else 128,
                                                             200 if tiny else 2048, 8)],
    }  # fmt: skip
    rows = []
    for batch, lens in batches.items():
        ids, mask = left_padded(lens, vocab, gen, device, low=3)
        providers = {"stock_default": dict(calls=1)}
        if device == "cuda" and (batch.startswith("batch1") or args.static_ragged):
            providers["stock_static_compile"] = dict(calls=args.calls,
                                                     cache_implementation="static")  # fmt: skip
        providers["nanoserve"] = dict(calls=args.calls)
        baseline = None
        for name, opts in providers.items():
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            opts = dict(opts)
            calls = opts.pop("calls")
            row = dict(model=family, batch=batch, provider=name)
            try:
                if name == "nanoserve":
                    nanoserve.patch_model(model)
                    opts["salted"] = True
                out, secs = timed(model, ids, mask, args.new_tokens, device, calls, **opts)
                if name == "nanoserve":
                    row["loop"] = nanoserve.decode_graph_stats(model)["decode_loop"]
            except Exception as e:  # a provider this transformers version lacks: say so
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
                print(f"{family} {batch} {name}: {row['error']}", file=sys.stderr)
                rows.append(row)
                continue
            finally:
                nanoserve.unpatch_model(model)
            baseline = out if baseline is None else baseline
            row["tok/s"] = round(out.numel() / secs, 1)
            row["seconds"] = round(secs, 3)
            if device == "cuda":
                row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            row["same_tokens_as_stock"] = f"{(out == baseline).float().mean().item():.1%}"
            rows.append(row)
            print(row, flush=True)
    return rows


def hf_cache_bytes(cache, sliding: bool | None = None) -> int:
    """Bytes of the K/V tensors an HF cache holds (K and V of every layer, or of its sliding
    layers only, or of the others only)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if sliding is not None and bool(getattr(layer, "is_sliding", False)) != sliding:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def memory_rows(model, family: str, device: str, tiny: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    opts = dict(return_dict_in_generate=True, prefill_chunk_size=512 if tiny else PREFILL_CHUNK)
    rows = []
    for tokens in (1024, 4096) if tiny else (8192, 32768):
        ids, mask = left_padded([tokens], model.config.vocab_size, gen, device, low=3)
        for name in ("stock_default", "nanoserve"):
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            row = dict(model=family, prompt_tokens=tokens, provider=name)
            try:
                if name == "nanoserve":
                    nanoserve.patch_model(model, keep_pools=False)
                out, secs = run_generate(model, ids, mask, 8, device, **opts)
                if name == "nanoserve":
                    stats = nanoserve.cache_stats(model)
                    row["kv_held_MiB"] = round(stats["bytes_reserved"] / MIB, 1)
                    row["kv_holding_tokens_MiB"] = round(stats["bytes_holding_tokens"] / MIB, 1)
                    row["blocks_used"] = stats["blocks_used"]
                    row["num_blocks"] = stats["num_blocks"]
                    row["blocks_dropped"] = stats.get("blocks_dropped_by_window", "")
                    row.update(group_columns(stats))
                    full = full_cache_bytes(model, stats["tokens"])
                    row["vs_full_cache"] = round(stats["bytes_holding_tokens"] / full, 3)
                else:
                    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                    row["kv_held_MiB"] = round(hf_cache_bytes(cache) / MIB, 1)
                    if getattr(model.config, "layer_types", None) and "sliding_attention" in set(
                        model.config.layer_types
                    ):  # the same columns as nanoserve's layer groups, from HF's layers
                        for kind, sliding in (("global", False), ("sliding", True)):
                            held = hf_cache_bytes(cache, sliding) / MIB
                            row[f"{kind}_MiB"] = round(held, 1)
                del out
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
                print(f"{family} {tokens} {name}: {row['error']}", file=sys.stderr)
                rows.append(row)
                continue
            finally:
                nanoserve.unpatch_model(model)
            row["seconds"] = round(secs, 2)
            if device == "cuda":
                row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            rows.append(row)
            print(row, flush=True)
        stock, ours = (
            next((r for r in rows[-2:] if r["provider"] == p and "kv_held_MiB" in r), None)
            for p in ("stock_default", "nanoserve")
        )
        if stock and ours and stock["kv_held_MiB"]:
            ours["vs_stock"] = round(ours["kv_held_MiB"] / stock["kv_held_MiB"], 2)
    return rows


def group_columns(stats: dict) -> dict:
    """MiB reserved by the global and the sliding layer group's pools ("" with one pool)."""
    if stats.get("layer_groups", 1) < 2:
        return {}
    out = {}
    for g in range(stats["layer_groups"]):
        kind = "sliding" if stats[f"group{g}_window"] else "global"
        out[f"{kind}_MiB"] = round(stats[f"group{g}_bytes_reserved"] / MIB, 1)
        out[f"{kind}_blocks"] = stats[f"group{g}_blocks_used"]
    return out


def full_cache_bytes(model, tokens: int) -> int:
    """Bytes a cache holding every token of every layer would take (K and V)."""
    layout = nanoserve.adapters.family_for(model.config).layout(model.config)
    per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
    return tokens * per_token * model.dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="gemma2,gemma3", help="comma-separated families")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=3, help="timed calls after the warm-up")
    parser.add_argument("--static-ragged", action="store_true",
                        help="also the static cache + compile on the ragged batch")  # fmt: skip
    parser.add_argument("--no-memory", action="store_true", help="skip the 8k / 32k rows")
    parser.add_argument("--no-speed", action="store_true", help="only the 8k / 32k rows")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    speed, memory = [], []
    for family in args.only.split(","):
        model = build_model(family, args.tiny, device, max_len=40000)
        if not args.no_speed:
            speed += speed_rows(model, family, device, args, args.tiny)
        if not args.no_memory:
            memory += memory_rows(model, family, device, args.tiny)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}")
    columns = ["model", "batch", "provider", "tok/s", "seconds", "peak_GiB",
               "same_tokens_as_stock", "loop", "error"]  # fmt: skip
    if speed:
        speed = [{c: r.get(c, "") for c in columns} for r in speed]
        write_csv(speed, "families_speed.csv")
        print_table(speed, columns)
    if memory:
        columns = ["model", "prompt_tokens", "provider", "kv_held_MiB", "vs_stock",
                   "kv_holding_tokens_MiB", "vs_full_cache", "global_MiB", "sliding_MiB",
                   "global_blocks", "sliding_blocks", "blocks_used", "num_blocks",
                   "blocks_dropped", "seconds", "peak_GiB", "error"]  # fmt: skip
        memory = [{c: r.get(c, "") for c in columns} for r in memory]
        write_csv(memory, "families_memory.csv")
        print_table(memory, columns)


if __name__ == "__main__":
    main()
