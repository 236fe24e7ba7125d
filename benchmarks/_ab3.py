import os, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import build_model, make_batches, run_generate, timed
from profile_decode_step import replay_gpu_us, kernels_per_step
import nanoserve
from nanoserve.adapters import fused_residual

ADDS = fused_residual._ADDS
CONFIGS = {  # name: (PDL on, residual adds fused)
    "default (PDL + residual)": (True, True),
    "PDL, adds apart": (True, False),
    "neither": (False, False),
}
model = build_model(False, "cuda")
batches = make_batches(False, "cuda", model.config.vocab_size)
rows, ref = [], {}
for rnd in range(2):
    for name, (pdl, residual) in CONFIGS.items():
        os.environ["NANOSERVE_PDL"] = "1" if pdl else "0"
        fused_residual._ADDS = ADDS if residual else set()
        nanoserve.patch_model(model)
        try:
            for b in ("batch1_prompt512", "ragged32_128to2048"):
                ids, mask, _ = batches[b]
                for _ in range(2):
                    run_generate(model, ids, mask, 2, "cuda")
                out, secs = timed(model, ids, mask, 256, "cuda", salted=True)
                same = float((out == ref[b]).float().mean()) if b in ref else 1.0
                ref.setdefault(b, out)
                gpu = launches = float("nan")
                if b.startswith("batch1") and rnd == 0:
                    gpu = replay_gpu_us(model)
                    launches, _, _ = kernels_per_step(lambda: run_generate(model, ids, mask, 64, "cuda"), 64)
                st = nanoserve.decode_graph_stats(model)["fused_decode"]
                rows.append((rnd, name, b, out.numel() / secs, gpu, launches, same, st["residual"]))
                print(rows[-1], flush=True)
        finally:
            nanoserve.unpatch_model(model)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
print("| round | config | batch | tok/s | replay µs | kernels/step | same tokens | residual adds fused |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]} | {r[6]} | {r[7]} |")
