"""A/B of a batch-1 decode step's launch changes in one process: programmatic dependent
launch (``NANOSERVE_PDL``), the residual adds run with their norms (``fused_residual``) and
the gated MLP in one launch (``fused_decode.FUSED_MLP_MAX_ROWS``; off: two launches and
the K shares' sum, as before), the step's rotary cos and sin in one launch (off: the rotary
embedding module's own forward, ``rotary_tables.fits`` refusing every call), q and k
rotated by the q/k/v launch (off: ``QKVRotary.tables_for`` refusing, the rotation a launch of
its own) and k and v stored in the pools by that launch (off: ``QKVRotary.store_target``
refusing, the cache's slot scatter a launch of its own).

Random-weight Llama-3.2-1B shape (``bench_generate.build_model``), bf16, greedy, 256 new
tokens. Per configuration and round (two rounds, interleaved): tokens/s at batch 1 (prompt
512) and on the ragged 32 (prompts 128..2048), the median of three salted calls after three
salted warm-ups of the same length (the pool grows and the graphs are captured before
timing); in the first round also the GPU time of one batch-1 graph replay and the kernels a
step launches. The residual fusion is switched off by watching no add
(``fused_residual._ADDS`` emptied for the configuration); every configuration must draw the
first one's tokens, but for the MLP switch, which sums down's products in another order
(the tables, the rotation ahead and the store are bit-equal to what they replace: the same
tokens).
Usage: cd benchmarks && python3 ab_decode_step.py [--configs NAME,NAME]
"""

from __future__ import annotations

import argparse
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
from nanoserve.adapters import fused_decode, fused_residual, qkv_rotary, rotary_tables  # noqa: E402

CONFIGS = {  # name: (PDL on, adds with their norms, MLP in one launch, tables, rotation ahead,
    # K/V stored by the q/k/v launch)
    "default": (True, True, True, True, True, True),
    "K/V scattered": (True, True, True, True, True, False),
    "MLP in two launches": (True, True, False, True, True, True),
    "rotation apart": (True, True, True, True, False, False),
    "rotary as before": (True, True, True, False, False, False),
    "PDL, adds apart": (True, False, True, True, True, True),
    "neither": (False, False, True, True, True, True),
}
BATCHES = ("batch1_prompt512", "ragged32_128to2048")


def measure(model, batches, name: str, first_round: bool, reference: dict) -> list[tuple]:
    pdl, residual, one_launch_mlp, tables, ahead, stored = CONFIGS[name]
    adds, mlp_rows = fused_residual._ADDS, fused_decode.FUSED_MLP_MAX_ROWS
    table_fits, tables_for = rotary_tables.fits, qkv_rotary.QKVRotary.tables_for
    store_target = qkv_rotary.QKVRotary.store_target
    os.environ["NANOSERVE_PDL"] = "1" if pdl else "0"
    fused_residual._ADDS = adds if residual else set()
    fused_decode.FUSED_MLP_MAX_ROWS = mlp_rows if one_launch_mlp else 0
    rotary_tables.fits = table_fits if tables else lambda *args: False
    qkv_rotary.QKVRotary.tables_for = tables_for if ahead else lambda *args: None
    qkv_rotary.QKVRotary.store_target = store_target if stored else lambda *args: None
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
            counts = nanoserve.decode_graph_stats(model)["fused_decode"]
            kinds = ("residual", "rotary_table", "rotary_qkv", "kv_store")
            fused = "/".join(str(counts[k]) for k in kinds)
            rows.append((name, batch, out.numel() / secs, gpu_us, launches, same, fused))
            print(rows[-1], flush=True)
    finally:
        nanoserve.unpatch_model(model)
        fused_residual._ADDS = adds
        fused_decode.FUSED_MLP_MAX_ROWS = mlp_rows
        rotary_tables.fits = table_fits
        qkv_rotary.QKVRotary.tables_for = tables_for
        qkv_rotary.QKVRotary.store_target = store_target
        os.environ.pop("NANOSERVE_PDL")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="names from CONFIGS")
    configs = parser.parse_args().configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    model = build_model(False, "cuda")
    batches = make_batches(False, "cuda", model.config.vocab_size)
    reference: dict = {}
    rows = []
    for round_ in range(2):
        for name in configs:
            rows += [(round_, *r) for r in measure(model, batches, name, round_ == 0, reference)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("fused: a step's residual adds with their norms / tables / rotations done ahead / K/V")
    print("rows stored by the q/k/v launch")
    print("| round | config | batch | tok/s | replay µs | kernels/step | same tokens | fused |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]} | {r[6]} | {r[7]} |")


if __name__ == "__main__":
    main()
