"""Random sequences of generate calls on one patched model against an unpatched copy of it.

Each call draws its prompts (left padded; rows repeated, sharing a prefix with another row of
the call or with an earlier call's, or their own), its decoding (greedy, sampling with HF's
processors, beams, ``num_return_sequences``, one or two EOS ids, ``min_new_tokens``, a
repetition penalty, ``max_length``, ``prefill_chunk_size``, a streamer, one that raises
midway) and torch's mode around it (no_grad, inference_mode, autograd on), and sometimes
continues the cache it returned; each model draws its patch options (block size, a small
pool, no kept pools, no prefix sharing, HF's loop, the Triton kernels), and between calls a
weight may be updated in place, the model patched again or its memory released. So what
one call leaves behind (kept blocks, cached prefixes, graph buckets, a failed call's state)
meets the next call's other shape and weights. Where stock raises, the patched model must
raise the same; after every call torch's RNG state must be stock's. The seed is fresh each
run and named in every failure; ``NANOSERVE_RANDOM_CALLS_SEED=<seed>`` replays it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import warnings

import test_families
import test_more_families
import test_new_families
import torch
from helpers import INTERPRETING, RecordingStreamer, cache_name, sharpen

import nanoserve
from nanoserve.adapters.hf import CHUNKED_CONTINUATION_FROM
from nanoserve.adapters.versions import transformers_before
from nanoserve.cache import OutOfBlocks

MAKERS = {
    name: module.tiny_model
    for module in (test_families, test_more_families, test_new_families)
    for name in module.CONFIGS
}
TRIALS = 4
RELATIVE_TOLERANCE = 1e-4
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
         "autograd": contextlib.nullcontext}  # fmt: skip


class StreamerStopped(Exception):
    """What ``StoppingStreamer`` raises."""


class StoppingStreamer(RecordingStreamer):
    """Raises ``StreamerStopped`` at its ``after + 1``-th put (a consumer that gave up)."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def put(self, value):
        super().put(value)
        if len(self.puts) > self.after:
            raise StreamerStopped(f"after {self.after} puts")


def random_model(rng: random.Random):
    """(family name, stock model, copy to patch): float32, matrices drawn large."""
    name = rng.choice(sorted(MAKERS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sharpen(MAKERS[name](name, seed=rng.randrange(1000)))
    return name, model, copy.deepcopy(model)


def random_patch_options(rng: random.Random) -> dict:
    """patch_model's options; the Triton kernels (under the interpreter on CPU) now and then."""
    options = {}
    if INTERPRETING and rng.random() < 0.25:
        options["backend"] = "triton"
    if rng.random() < 0.5:
        options["block_size"] = rng.choice([1, 2, 3, 5, 8])
    if rng.random() < 0.2:
        options["num_blocks"] = rng.choice([60, 200])
    for name in ("keep_pools", "prefix_sharing", "decode_loop"):
        if rng.random() < 0.2:
            options[name] = False
    return options


def random_prompts(rng: random.Random, vocab: int, earlier: list[list[int]]) -> dict:
    """Left-padded input_ids and attention_mask of 1-4 rows, some repeating or extending the
    first row's tokens, which half the time begin with an ``earlier`` call's row (what prefix
    sharing finds within a call and across calls). Appends the rows to ``earlier``."""
    first = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
    if earlier and rng.random() < 0.5:
        before = rng.choice(earlier)
        first = before[: rng.randint(1, len(before))] + first[: rng.randint(0, 8)]
    rows = []
    for _ in range(rng.randint(1, 4)):
        draw = rng.random()
        if draw < 0.3:
            rows.append(list(first))
        elif draw < 0.6:
            own = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 20))]
            rows.append(first[: rng.randint(1, len(first))] + own)
        else:
            rows.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))])
    earlier.extend(rows)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    return dict(input_ids=ids, attention_mask=mask)


def random_decoding(rng: random.Random, vocab: int, width: int) -> dict:
    """generate's arguments for prompts ``width`` columns wide; the per-step logits are always
    returned (see ``compare``)."""
    kwargs = dict(
        max_new_tokens=rng.randint(1, 16),
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=rng.random() < 0.5,
    )
    draw = rng.random()
    if draw < 0.4:
        kwargs["do_sample"] = False
    elif draw < 0.85:
        kwargs["do_sample"] = True
        kwargs["temperature"] = rng.choice([0.6, 1.0, 1.3])
        kwargs["top_k"] = rng.choice([0, 5, 20])
        kwargs["top_p"] = rng.choice([1.0, 0.8])
        if rng.random() < 0.2:
            kwargs["min_p"] = 0.1
        kwargs["num_return_sequences"] = rng.choice([1, 1, 2, 3])
    else:
        kwargs.update(do_sample=False, num_beams=rng.randint(2, 3))
        kwargs["num_return_sequences"] = rng.randint(1, kwargs["num_beams"])
    if rng.random() < 0.3:
        kwargs["repetition_penalty"] = rng.choice([1.3, 0.8])
    eos = rng.random()
    kwargs["eos_token_id"] = (
        None
        if eos < 0.3
        else rng.randrange(3, vocab)
        if eos < 0.7
        else [rng.randrange(3, vocab), rng.randrange(3, vocab)]
    )
    if kwargs["eos_token_id"] is not None and rng.random() < 0.3:
        kwargs["min_new_tokens"] = rng.randint(1, kwargs["max_new_tokens"])
    if rng.random() < 0.15:
        kwargs["max_length"] = kwargs.pop("max_new_tokens") + width
    return kwargs


def outputs(out, streamer) -> dict:
    """A generate output's sequences, per-step logits and scores, and streamed tokens."""
    result = dict(sequences=out.sequences, logits=torch.stack(out.logits))
    if out.scores is not None:
        result["scores"] = torch.stack(out.scores)
    if streamer is not None:
        result["streamed"] = ([put.tolist() for put in streamer.puts], streamer.ended)
    return result


def run(model, inputs, kwargs, continue_with, streamer, seed: int, mode: str) -> list[dict]:
    """One call's ``outputs`` under torch mode ``mode`` (of ``MODES``); with
    ``continue_with`` (tokens of each row's next turn), also those of a second call on the
    cache the first returned."""
    torch.manual_seed(seed)
    with MODES[mode]():
        out = model.generate(
            **inputs, **kwargs, streamer=None if continue_with is not None else streamer
        )
        if continue_with is None:
            return [outputs(out, streamer)]
        sequences = torch.cat([out.sequences, continue_with], 1)
        own = torch.ones_like(sequences[:, inputs["attention_mask"].shape[1] :])
        second = model.generate(
            input_ids=sequences,
            attention_mask=torch.cat([inputs["attention_mask"], own], 1),
            streamer=streamer,
            **{cache_name(model): getattr(out, cache_name(model))},
            **kwargs,
        )
    return [outputs(out, None), outputs(second, streamer)]


def first_difference(stock: torch.Tensor, paged: torch.Tensor) -> int | None:
    """The first generated step at which ``stock`` and ``paged`` (rows, tokens) differ."""
    if stock.shape != paged.shape:
        return 0
    differs = (stock != paged).any(0).nonzero()
    return None if differs.numel() == 0 else int(differs[0])


def compare(stock: dict, paged: dict, beams: bool) -> str | None:
    """Why ``paged`` is not stock's output, or None. A sampled or greedy token may differ where
    the two calls' logits agree to rounding (the paged attention sums in another order): then
    the steps up to and including that one must agree, and the rest is not compared. Beam
    search must give stock's sequences."""
    steps = stock["logits"].shape[0]
    differ_at = first_difference(stock["sequences"], paged["sequences"])
    if differ_at is not None:
        if beams or paged["sequences"].shape != stock["sequences"].shape:
            return f"sequences {stock['sequences'].tolist()} != {paged['sequences'].tolist()}"
        steps = differ_at - (stock["sequences"].shape[1] - steps) + 1
    elif stock.get("streamed") != paged.get("streamed"):
        return f"streamed {stock.get('streamed')} != {paged.get('streamed')}"
    for field in ("logits", "scores"):
        if (field in stock) != (field in paged):
            return f"{field} returned by one only"
        if field not in stock:
            continue
        a, b = stock[field][:steps], paged[field][:steps]
        if a.shape != b.shape:
            return f"{field} shape {tuple(a.shape)} != {tuple(b.shape)}"
        finite = torch.isfinite(a)
        if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
            return f"{field}: not finite at other places"
        if finite.any():
            worst = (a[finite] - b[finite]).abs().max().item()
            if worst > RELATIVE_TOLERANCE * max(a[finite].abs().max().item(), 1.0):
                return f"{field} differ by {worst:.3g} within the first {steps} steps"
    return None


def between_calls(rng: random.Random, stock, paged, options: dict) -> dict:
    """Now and then, what a program does between calls: a weight updated in place in both
    models (a training step between rollouts), or ``paged`` patched again with other options.
    Returns the options ``paged`` is patched with."""
    draw = rng.random()
    if draw < 0.15:
        name = rng.choice([name for name, _ in stock.named_parameters()])
        weight = dict(stock.named_parameters())[name]
        step = torch.randn(
            weight.shape, generator=torch.Generator().manual_seed(rng.randrange(1000))
        )
        step *= 0.3 * weight.detach().abs().mean()
        with torch.no_grad():
            for model in (stock, paged):
                dict(model.named_parameters())[name].add_(step)
    elif draw < 0.25:
        options = random_patch_options(rng)
        nanoserve.patch_model(paged, **options)
    elif draw < 0.35:
        nanoserve.release_memory(paged)
    return options


def new_streamer(stop_after: int | None, stream: bool):
    """A ``StoppingStreamer`` stopping after ``stop_after`` puts, else a recording one or none."""
    if stop_after is not None:
        return StoppingStreamer(stop_after)
    return RecordingStreamer() if stream else None


def attempt(model, inputs, kwargs, continue_with, streamer, seed, mode):
    """(``run``'s outputs or None, the exception it raised or None, torch's RNG state)."""
    try:
        result, error = run(model, inputs, kwargs, continue_with, streamer, seed, mode), None
    except (OutOfBlocks, StreamerStopped, ValueError, RuntimeError) as raised:
        result, error = None, raised
    return result, error, torch.get_rng_state()


def one_trial(seed: int) -> list[str]:
    """Problems found in one random model's sequence of calls (empty: every call was stock's
    or refused for want of blocks)."""
    rng = random.Random(seed)
    name, stock, paged = random_model(rng)
    vocab = stock.config.vocab_size
    options = random_patch_options(rng)
    nanoserve.patch_model(paged, **options)
    problems, earlier = [], []
    try:
        for call in range(rng.randint(2, 4)):
            if call:
                options = between_calls(rng, stock, paged, options)
            inputs = random_prompts(rng, vocab, earlier)
            kwargs = random_decoding(rng, vocab, inputs["input_ids"].shape[1])
            mode = rng.choice(["no_grad", "no_grad", "inference_mode", "autograd"])
            beams = kwargs.get("num_beams", 1) > 1
            continue_with = None
            one_row_each = kwargs.get("num_return_sequences", 1) == 1
            if not beams and one_row_each and "max_length" not in kwargs and rng.random() < 0.25:
                turn = rng.randint(1, 5)
                continue_with = torch.tensor(
                    [[rng.randrange(3, vocab) for _ in range(turn)] for _ in inputs["input_ids"]]
                )
            # (before 5.24 a chunked prefill continuing a returned cache is refused, documented)
            chunks_allowed = continue_with is None or not transformers_before(
                CHUNKED_CONTINUATION_FROM
            )
            if rng.random() < 0.2 and chunks_allowed:
                kwargs["prefill_chunk_size"] = rng.choice([2, 3, 5, 8, 16])
            stop_after = rng.randint(0, 6) if not beams and rng.random() < 0.1 else None
            stream = not beams and rng.random() < 0.2

            where = (
                f"{name} {options} call {call} under {mode}: {kwargs}, continued: "
                f"{continue_with is not None}, streamer stops after: {stop_after}"
            )
            call_args = (inputs, kwargs, continue_with)
            streamers = [new_streamer(stop_after, stream) for _ in range(2)]
            expected, stock_error, stock_rng = attempt(
                stock, *call_args, streamers[0], seed + call, mode
            )
            got, error, rng_state = attempt(paged, *call_args, streamers[1], seed + call, mode)
            if isinstance(error, OutOfBlocks):
                if "num_blocks" not in options:
                    problems.append(f"{where}: out of blocks without a num_blocks cap")
                continue
            if stock_error is not None or error is not None:
                if type(stock_error) is not type(error):
                    problems.append(f"{where}: stock raised {stock_error!r}, patched {error!r}")
                elif not torch.equal(stock_rng, rng_state):
                    problems.append(f"{where}: RNG state after the raise is not stock's")
                elif isinstance(error, StreamerStopped):
                    puts = [[put.tolist() for put in st.puts] for st in streamers]
                    if puts[0] != puts[1]:
                        problems.append(
                            f"{where}: streamed before the raise {puts[1]} != {puts[0]}"
                        )
                continue
            same = True
            for stock_call, paged_call in zip(expected, got, strict=True):
                why = compare(stock_call, paged_call, beams)
                if why:
                    problems.append(f"{where}: {why}")
                if not torch.equal(stock_call["sequences"], paged_call["sequences"]):
                    same = False
                    break  # a rounding tie (compare): the next turn starts from other tokens
            if same and not torch.equal(stock_rng, rng_state):
                problems.append(f"{where}: RNG state after the call is not stock's")
    finally:
        nanoserve.unpatch_model(paged)
    return problems


def test_random_calls_give_stocks_outputs():
    """Each trial's calls give stock's sequences, logits, scores and streamed tokens, or
    refuse for want of blocks in a pool capped by ``num_blocks`` (and the next calls go on).
    Planted, over seeds 11-16 under TRITON_INTERPRET=1 (all 6 pass unplanted): the chained
    block digest skipping each block's last token failed 3 of the 6 runs; the decode loop's
    repetition penalty forgetting the prompt's tokens 3 of 6; the prefix salt ignoring the
    weights (a cached prefix served after a weight update) 1 of 6, which
    test_prefix_invalidation checks every run; a random number drawn at the start of the
    patched generate, seed 11: "RNG state after the call is not stock's" (greedy calls too);
    each streamed tensor put twice, seeds 300-339: five "streamed before the raise".
    Not a failure: transformers <5.24 refusing a chunked prefill that continues a returned
    cache (documented; not drawn there). Stock itself may differ from process to process:
    seed 1 (Gemma) gave a padded row's rotary ``cos`` of the same positions 1.5e-4 apart
    in one process of four, its logits 9e-4 (one seed in 160; the cause not pinned down):
    such a failure replays clean in another process."""
    base = int(os.environ.get("NANOSERVE_RANDOM_CALLS_SEED", 0)) or int.from_bytes(
        os.urandom(4), "little"
    )
    problems = []
    for trial in range(TRIALS):
        seed = base + 1000 * trial
        problems += [f"seed {seed}: {p}" for p in one_trial(seed)]
    assert not problems, f"NANOSERVE_RANDOM_CALLS_SEED={base}\n" + "\n".join(problems)
