"""A/B of a batch-1 decode step's launch changes in one process: programmatic dependent
launch (``NANOSERVE_PDL``) and the residual adds run with their norms (``fused_residual``).

Random-weight Llama-3.2-1B shape (``bench_generate.build_model``), bf16, greedy, 256 new
tokens. Per configuration and round (two rounds, interleaved): tokens/s at batch 1 (prompt
512) and on the ragged 32 (prompts 128..2048), the median of three salted calls after three
salted warm-ups of the same length (the pool grows and the graphs are captured before
timing); in the first round also the GPU time of one batch-1 graph replay and the kernels a
step launches. The residual fusion is switched off by watching no add
(``fused_residual._ADDS`` emptied for the configuration); every configuration must draw the
first one's tokens. Usage: cd benchmarks && python3 ab_decode_step.py
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import build_model, make_batches, run_generate, timed, warm_up  # noqa: E402
from profile_decode_step import kernels_per_step, replay_gpu_us  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.adapters import fused_residual  # noqa: E402

CONFIGS = {  # name: (PDL on, residual adds run with their norms)
    "default (PDL + residual)": (True, True),
    "PDL, adds apart": (True, False),
    "neither": (False, False),
}
BATCHES = ("batch1_prompt512", "ragged32_128to2048")


def measure(model, batches, name: str, first_round: bool, reference: dict) -> list[tuple]:
    pdl, residual = CONFIGS[name]
    adds = fused_residual._ADDS
    os.environ["NANOSERVE_PDL"] = "1" if pdl else "0"
    fused_residual._ADDS = adds if residual else set()
    nanoserve.patch_model(model)
    rows = []
    try:
        for batch in BATCHES:
            ids, mask, _ = batches[batch]
            warm_up(model, ids, mask, 256, "cuda")
            out, secs = timed(model, ids, mask, 256, "cuda", salted=True)
            same = bool(torch.equal(out, reference.setdefault(batch, out)))
            gpu_us = launches = float("nan")
            if first_round and batch.startswith("batch1"):
                gpu_us = replay_gpu_us(model)
                run = functools.partial(run_generate, model, ids, mask, 64, "cuda")
                launches = kernels_per_step(run, 64)[0]
            fused = nanoserve.decode_graph_stats(model)["fused_decode"]["residual"]
            rows.append((name, batch, out.numel() / secs, gpu_us, launches, same, fused))
            print(rows[-1], flush=True)
    finally:
        nanoserve.unpatch_model(model)
        fused_residual._ADDS = adds
        os.environ.pop("NANOSERVE_PDL")
    return rows


def main() -> None:
    model = build_model(False, "cuda")
    batches = make_batches(False, "cuda", model.config.vocab_size)
    reference: dict = {}
    rows = []
    for round_ in range(2):
        for name in CONFIGS:
            rows += [(round_, *r) for r in measure(model, batches, name, round_ == 0, reference)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| round | config | batch | tok/s | replay µs | kernels/step | same tokens | residual |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]} | {r[6]} | {r[7]} |")


if __name__ == "__main__":
    main()
