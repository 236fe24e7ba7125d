"""A/B of nanoserve's decode loop with and without its host-light steps, in one process.

Configurations: "before" (every decode step calls the model, the token choice runs eagerly,
as until 3290bd1), "direct" (decode steps straight on the graph runner,
``graph_forward.loop_decode_step``) and "direct+choice" (the default: the token choice
replayed as a graph too, ``loop_choice.TokenChoice``). Random-weight Llama-3.2-1B shape
(``bench_generate.build_model``), bf16, greedy. Per configuration and round (two rounds,
interleaved): a batch-1 step's time, (257-token call - 1-token call) / 256 with prompt 512,
and tokens/s on the ragged 32 (prompts 128..2048, 256 new tokens), each the median of three
salted calls; every configuration must give the first one's tokens. ``--sample`` samples
(top_k 50, each call seeded alike) with "direct" and "direct+choice" only, and times 64 rows
of one 512-token prompt in place of the ragged 32. ``--busy-thread`` runs another Python
thread of the process spinning (switch interval 0.5 ms), as a data loader or tokenizer
thread would hold the interpreter lock: an exaggerated busy host.
Usage: cd benchmarks && python3 ab_loop_steps.py [--sample] [--busy-thread] [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import build_model, fresh_salt, left_padded, sync  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.adapters import decode_loop  # noqa: E402

_REAL = (decode_loop.loop_decode_step, decode_loop._captures)
CONFIGS = {
    "before": (lambda *args: None, lambda *args: False),
    "direct": (_REAL[0], lambda *args: False),
    "direct+choice": _REAL,
}


def use(name: str) -> None:
    decode_loop.loop_decode_step, decode_loop._captures = CONFIGS[name]


SAMPLE = dict(do_sample=True, top_k=50)


def call(model, batch, new: int, device: str, sample: bool = False):
    """(seconds, sequences) of one call of ``new`` tokens that prefills its prompts: greedy,
    or sampled from seed 0."""
    ids, mask = batch
    options = SAMPLE if sample else dict(do_sample=False)
    torch.manual_seed(0)
    sync(device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=new, cache_salt=fresh_salt(), **options)  # fmt: skip
    sync(device)
    return time.perf_counter() - start, out


def spin() -> None:
    total = 0
    while True:
        for i in range(10_000):
            total += i


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--busy-thread", action="store_true")
    parser.add_argument("--sample", action="store_true", help="top_k 50, 64 rows of one prompt")
    parser.add_argument("--tiny", action="store_true", help="tiny model (any device)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        sys.exit("ab_loop_steps: needs a CUDA GPU (or --tiny)")
    model = build_model(args.tiny, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompt, low, high = (32, 8, 40) if args.tiny else (512, 128, 2048)
    rows = [int(n) for n in torch.linspace(low, high, 32)]
    single, ragged = (
        left_padded([prompt], vocab, gen, device),
        left_padded(rows, vocab, gen, device),
    )
    configs = list(CONFIGS)
    if args.sample:
        configs = ["direct", "direct+choice"]
        ragged = tuple(t.repeat(64, 1) for t in single)
    nanoserve.patch_model(model)
    if args.busy_thread:
        threading.Thread(target=spin, daemon=True).start()
        sys.setswitchinterval(0.0005)
    sample = args.sample
    for name in configs:  # warm every path: compiles and captures
        use(name)
        for _ in range(2):
            call(model, single, 64, device, sample)
            call(model, ragged, 16, device, sample)
    first, table = {}, []
    for round_ in range(2):
        for name in configs:
            use(name)
            one = statistics.median(call(model, single, 1, device, sample)[0] for _ in range(3))
            long = [call(model, single, 257, device, sample) for _ in range(3)]
            full = statistics.median(secs for secs, _ in long)
            many = [call(model, ragged, 256, device, sample) for _ in range(3)]
            tokens = (long[0][1], many[0][1])
            first.setdefault("tokens", tokens)
            same = all(torch.equal(a, b) for a, b in zip(tokens, first["tokens"], strict=True))
            steps = nanoserve.decode_graph_stats(model)["loop_steps"]
            table.append(
                (round_, name, (full - one) / 256 * 1e6, 257 / full,
                 ragged[0].shape[0] * 256 / statistics.median(secs for secs, _ in many), same,
                 steps)
            )  # fmt: skip
            print(table[-1], flush=True)
    use("direct+choice")
    batch = "64 rows" if sample else "ragged 32"
    print(
        f"| round | config | batch-1 step µs | batch-1 tok/s (257) | {batch} tok/s | same tokens |"
    )
    print("|---|---|---|---|---|---|")
    for round_, name, step, single_rate, ragged_rate, same, _ in table:
        print(
            f"| {round_} | {name} | {step:.1f} | {single_rate:.1f} | {ragged_rate:.1f} | {same} |"
        )


if __name__ == "__main__":
    main()
