"""Which INT8 K/V format meets issue 19's accuracy goal (mean |delta log-prob| <= 0.02) without
depending on calibration data?

SmolLM2-135M in float32 on the CPU, the text and model of ``fp8_accuracy.py``: one
teacher-forced forward over 2,048 tokens per variant, the post-RoPE K/V entering attention
replaced by their INT8 round trip (symmetric, round to nearest, float16 scales):
- scales per (token, KV head) and group of G channels of the head dim, for keys (G = 64,
  32, 16, 8) and values (the whole head, or 16);
- keys centred before rounding on a per-(layer, KV head, channel) mean taken from a
  calibration input (the first 128 tokens of the text itself, 256 random tokens, a short
  chat prompt, a repeated English sentence; with and without the first token): softmax
  ignores the shift q.m, so only the rounding changes.
Figures: mean and max |delta log-prob| of the true next token against unrounded K/V, and
argmax agreement.

    PYTHONPATH=. python benchmarks/int8_formats.py     (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import pathlib
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fp8_accuracy import TEXT, load  # noqa: E402

from nanoserve.kernels.quant import dequantize_int8, quantize_int8  # noqa: E402

torch.set_num_threads(2)
VARIANT: dict = {}  # the variant the attention below applies
CAPTURED: dict[int, torch.Tensor] = {}  # layer -> keys [B, H, T, D] of a calibration run


def round_trip(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [B, H, T, D] -> its INT8 round trip with ``group`` channels a scale (None: a row):
    the pools' own functions for the groups they use, plain torch for the others."""
    if group not in (None, 16):
        return _grouped(x.float(), group)
    values, scales = quantize_int8(x.float(), group)
    return dequantize_int8(values, scales, torch.float32)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """The round trip for groups the pools do not use (32, 64, 8), in plain torch."""
    g = x.reshape(*x.shape[:-1], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    scale = scale.clamp_min(2.0**-14)
    return ((g / scale).round().clamp(-127, 127) * scale).reshape(x.shape)


def attention(module, query, key, value, attention_mask, **kwargs):
    layer = module.layer_idx
    if VARIANT.get("capture"):
        CAPTURED[layer] = key.detach().float()
    elif VARIANT:
        mean = VARIANT.get("means", {}).get(layer)
        keys = key.float() - mean if mean is not None else key
        key = round_trip(keys, VARIANT["k_group"])
        value = round_trip(value, VARIANT["v_group"])
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("int8sim", attention)
AttentionMaskInterface.register("int8sim", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def main() -> None:
    model, tok = load("cpu")
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids[0][: 2048 + 1]
    truth = ids[1:]

    def logits(x):
        with torch.no_grad():
            return model(x[None]).logits[0, :-1].float()

    model.config._attn_implementation = "sdpa"
    base = logits(ids)
    base_true = torch.log_softmax(base, -1).gather(1, truth[:, None])[:, 0]
    model.config._attn_implementation = "int8sim"

    def means(x: torch.Tensor, skip_first: bool) -> dict[int, torch.Tensor]:
        VARIANT.clear()
        VARIANT["capture"] = True
        logits(x)
        VARIANT.clear()
        return {k: v[:, :, int(skip_first) :].mean(2, keepdim=True) for k, v in CAPTURED.items()}

    g = torch.Generator().manual_seed(0)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"][0]  # fmt: skip
    calibrations = {
        "text, first 128": ids[:128],
        "256 random tokens": torch.randint(0, model.config.vocab_size, (257,), generator=g),
        f"chat prompt ({chat.numel()})": chat,
        "a sentence x 20": tok(
            "The quick brown fox jumps over the lazy dog. " * 20, return_tensors="pt"
        ).input_ids[0][:256],  # fmt: skip
    }
    variants = [
        ("K, V: a scale per head", dict(k_group=None, v_group=None)),
        ("K per 32 channels, V per head", dict(k_group=32, v_group=None)),
        ("K per 16 channels, V per head (pools)", dict(k_group=16, v_group=None)),
        ("K, V per 16 channels", dict(k_group=16, v_group=16)),
        ("K per 8 channels, V per head", dict(k_group=8, v_group=None)),
    ]
    for name, x in calibrations.items():
        for skip in (False, True):
            label = f"K centred ({name}{', no 1st' if skip else ''}), V per head"
            variants.append((label, dict(k_group=None, v_group=None, means=means(x, skip))))
    print(f"{'variant':<62} {'mean|dlp|':>9} {'max':>6} {'argmax=':>8}")
    for name, variant in variants:
        VARIANT.clear()
        VARIANT.update(variant)
        lg = logits(ids)
        d = (torch.log_softmax(lg, -1).gather(1, truth[:, None])[:, 0] - base_true).abs()
        agree = (lg.argmax(-1) == base.argmax(-1)).float().mean().item()
        print(f"{name:<62} {d.mean():>9.4f} {d.max():>6.3f} {agree:>8.2%}", flush=True)


if __name__ == "__main__":
    main()
