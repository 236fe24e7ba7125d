"""``model.generate_batch``: transformers' continuous batching against nanoserve's (the same
call on a patched model runs one left-padded generate on the paged pool), on the GPU.

bench_generate's model (random-weight Llama-3.2-1B shape, bf16) and workloads (batch 1 with a
512-token prompt; 32 prompts of 128..2048 tokens), greedy, EOS off, 256 new tokens, the
prompts given unpadded as transformers' API takes them. transformers' call is timed once (it
builds its manager and captures its graphs inside the call, as a user meets it); nanoserve's
as the median of three calls after a warm-up, each with a fresh ``cache_salt`` so it
prefills its prompts (none is found in the prefix cache the warm-up filled). Columns:
tokens/s, seconds, speed-up over transformers, how many generated tokens equal transformers'
(bf16: the two compute attention differently, so near-ties may differ), and, to tell which
side drifts, how many equal stock ``generate``'s (greedy, the model unpatched, the prompts
left-padded in one call) and the
median step at which a request first differs from it ("-": none differs). Usage:
    python3 benchmarks/bench_generate_batch.py [--new-tokens 256] [--tiny]
(``--tiny``: a 2-layer model on any device, a smoke test, not a benchmark.)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import require_cuda  # noqa: E402

if "--tiny" not in sys.argv:
    require_cuda("bench_generate_batch")

from bench_generate import build_model, make_batches, sync  # noqa: E402
from harness import fresh_salt, show_table  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.adapters.generate_batch import eos_ids, left_padded  # noqa: E402

COLUMNS = ["workload", "provider", "tok/s", "seconds", "x_transformers", "tokens_equal"]
COLUMNS += ["equal_stock", "first_diff_stock"]


def stock_generate(model, prompts: list[list[int]], config) -> dict[str, list]:
    """{request id: new tokens} of stock greedy ``generate`` (model unpatched) on the prompts
    left-padded into one batch."""
    config = copy.deepcopy(config)
    # as generate_batch reads it: None and -1 (which transformers' call writes into the
    # config it is given) mean no EOS, not the model's
    config.eos_token_id = sorted(eos_ids(config))
    ids, mask = left_padded(prompts, config.pad_token_id or 0, model)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out[:, ids.shape[1] :].tolist()
    return {f"req_{i}": row for i, row in enumerate(new)}


def agreement(ours: dict[str, list], stock: dict[str, list]) -> tuple[str, str]:
    """(tokens equal position by position "equal/total", median first differing step or
    "-" when every request equals stock's)."""
    equal = sum(sum(a == b for a, b in zip(ours[k], stock[k], strict=False)) for k in stock)
    total = sum(len(t) for t in stock.values())
    firsts = [
        next((i for i, (a, b) in enumerate(zip(ours[k], stock[k], strict=False)) if a != b),
             None if len(ours[k]) == len(stock[k]) else min(len(ours[k]), len(stock[k])))
        for k in stock
    ]  # fmt: skip
    differing = [f for f in firsts if f is not None]
    return f"{equal}/{total}", str(int(statistics.median(differing))) if differing else "-"


def timed_batch(model, prompts: list[list[int]], config, device: str, **kwargs):
    """({request id: generated tokens}, seconds) of one generate_batch call (``kwargs``:
    a patched model's ``cache_salt``)."""
    sync(device)
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
    sync(device)
    return {k: list(r.generated_tokens) for k, r in results.items()}, time.perf_counter() - start


def main() -> None:
    from transformers import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--tiny", action="store_true", help="smoke test on any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.tiny, device)
    new = 8 if args.tiny else args.new_tokens
    config = GenerationConfig(
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    rows = []
    for name, (ids, _, lens) in make_batches(args.tiny, device, model.config.vocab_size).items():
        prompts = [row[-n:].tolist() for row, n in zip(ids, lens, strict=True)]
        theirs, hf_seconds = timed_batch(model, prompts, config, device)
        stock = stock_generate(model, prompts, config)
        total = sum(len(t) for t in theirs.values())
        equal, first = agreement(theirs, stock)
        rows.append(dict(workload=name, provider="transformers generate_batch",
                         **{"tok/s": round(total / hf_seconds, 1)},
                         seconds=round(hf_seconds, 3), x_transformers=1.0,
                         tokens_equal=f"{total}/{total}", equal_stock=equal,
                         first_diff_stock=first))  # fmt: skip
        nanoserve.patch_model(model)
        try:
            timed_batch(model, prompts, config, device)  # compiles, captures, sizes the pool
            # each timed call prefills its prompts, as transformers' does (harness.fresh_salt)
            calls = [
                timed_batch(model, prompts, config, device, cache_salt=fresh_salt())
                for _ in range(3)
            ]
        finally:
            nanoserve.unpatch_model(model)
        ours = calls[0][0]
        seconds = statistics.median(s for _, s in calls)
        same = sum(
            sum(a == b for a, b in zip(ours[k], theirs[k], strict=False)) for k in theirs
        )  # fmt: skip
        equal, first = agreement(ours, stock)
        rows.append(dict(workload=name, provider="nanoserve generate_batch",
                         **{"tok/s": round(sum(len(t) for t in ours.values()) / seconds, 1)},
                         seconds=round(seconds, 3), x_transformers=round(hf_seconds / seconds, 2),
                         tokens_equal=f"{same}/{total}", equal_stock=equal,
                         first_diff_stock=first))  # fmt: skip
    show_table(rows, "generate_batch.csv", COLUMNS)


if __name__ == "__main__":
    main()
