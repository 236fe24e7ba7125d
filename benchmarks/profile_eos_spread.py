"""Where a call with rows ending apart spends its GPU time, by the batch's size.

Issue 15's EOS-spread call (``bench_generate.py --eos-spread``: 64 sampled rows of one
512-token prompt, top-k 50, ``min_new_tokens`` 32, up to 512 new tokens, the EOS row of the
output embedding scaled ``--eos-scale``; random Llama-3.2-1B shapes, bf16) on the patched
model: CUDA events around every decode step and every token choice of the loop, then per
batch size the steps, the median µs of each part and their sums, beside the calls' wall
time. Needs a CUDA GPU.

Usage: python3 benchmarks/profile_eos_spread.py [--calls 6] [--eos-scale 3.668]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import fresh_salt, require_cuda  # noqa: E402

require_cuda("profile_eos_spread")

from bench_generate import build_model, eos_lengths, left_padded  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.adapters import decode_loop, loop_choice  # noqa: E402

EOS, ROWS, PROMPT, LOW, HIGH = 2, 64, 512, 32, 512


class PartTimer:
    """CUDA events around the loop's decode steps and token choices: (part, rows, start,
    end) per step, read after the call."""

    def __init__(self):
        self.records: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self.step = decode_loop.loop_decode_step
        self.choice = loop_choice.TokenChoice.__call__
        timer = self

        def step(model, cache, fixed, ids, positions):
            start = _event()
            logits = timer.step(model, cache, fixed, ids, positions)
            timer.records.append(("decode", ids.shape[0], start, _event()))
            return logits

        def choice(self, logits, *rest):
            start = _event()
            chosen = timer.choice(self, logits, *rest)
            timer.records.append(("choice", logits.shape[0], start, _event()))
            return chosen

        decode_loop.loop_decode_step = step
        loop_choice.TokenChoice.__call__ = choice

    def remove(self) -> None:
        decode_loop.loop_decode_step = self.step
        loop_choice.TokenChoice.__call__ = self.choice


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--eos-scale", type=float, default=3.668)
    args = parser.parse_args()
    model = build_model(False, "cuda")
    gen = torch.Generator().manual_seed(8)
    ids, mask = left_padded([PROMPT], model.config.vocab_size, gen, "cuda")
    ids, mask = ids.repeat(ROWS, 1), mask.repeat(ROWS, 1)
    sample = dict(do_sample=True, top_k=50, eos_token_id=EOS, pad_token_id=0,
                  min_new_tokens=LOW, max_new_tokens=HIGH)  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight[EOS] *= args.eos_scale
    timer = PartTimer()
    nanoserve.patch_model(model)
    try:

        def call(seed: int) -> tuple[torch.Tensor, float]:
            torch.manual_seed(11 + seed)
            torch.cuda.synchronize()
            timer.records.clear()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, cache_salt=fresh_salt(),
                                 **sample)  # fmt: skip
            torch.cuda.synchronize()
            return out[:, PROMPT:], time.perf_counter() - start

        for seed in (0, 1):  # warm-ups: compiles, the decode graphs of every batch size
            call(seed)
        parts = collections.defaultdict(list)
        wall, steps, useful = 0.0, 0, 0
        for seed in range(2, 2 + args.calls):
            out, seconds = call(seed)
            wall += seconds
            steps += out.shape[1]
            useful += sum(eos_lengths(out, EOS))
            for part, rows, start, end in timer.records:
                parts[(part, rows)].append(start.elapsed_time(end) * 1e3)
    finally:
        timer.remove()
        nanoserve.release_memory(model)
        nanoserve.unpatch_model(model)
    print(f"{args.calls} calls: {wall * 1e3:.0f} ms, {steps} steps, {useful / wall:.1f} "
          f"useful tok/s ({torch.cuda.get_device_name()})")  # fmt: skip
    print(f"{'part':8s} {'rows':>4s} {'steps':>6s} {'median us':>10s} {'sum ms':>8s}")
    for (part, rows), times in sorted(parts.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        print(f"{part:8s} {rows:4d} {len(times):6d} {statistics.median(times):10.1f} "
              f"{sum(times) / 1e3:8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
