"""nanoserve's own loop for HF's greedy and multinomial sampling (``_sample``).

A patched model's ``generate`` reaches ``sample`` through the class hook (``sample_hook.py``)
with everything HF prepared: the processors, the stopping criteria, the expanded prompts and
the cache. ``stock_reason`` says whether the loop can give exactly what HF's ``_sample``
gives; if not, HF's ``_sample`` runs unchanged and the reason is kept
(``decode_graph_stats(model)["decode_loop"]``).

The loop prefills through HF's ``_prefill`` (so chunked prefill and prefix sharing are as
before), then runs each decode step with only the arguments a paged decode step needs:
where the patched forward would replay a captured graph, straight on the graph runner
(``graph_forward.loop_decode_step``: no module call, no model output, the logits lent from
the graph's buffer), else through the model. It processes the logits and picks the token on
the device (``device_sampling.py``, ``loop_choice.py``: choices whose scores and logits are
not returned replay a graph of their own, sampled ones too), and writes it into a preallocated
``sequences`` buffer. Which rows have finished is copied back without waiting
(``read_back.py``): the host learns it a few steps late, so the steps issued past the stop
are cut from the returned sequences, scores and logits and cropped from the cache, and the
random numbers they drew are given back: the result, and the RNG state after it, are stock's.
Sampling draws ``torch.multinomial``'s own random numbers (``multinomial_noise``) and picks
as it does (``pick_tokens``), without its checks' reads back to the host; whether a step's
distribution held NaN is read back with the rest and raises stock's error, the random state
put back where stock's raise leaves it.

Finished rows leave the batch (``ActiveRows``) when the rest fits a smaller graph bucket and
nothing of theirs past EOS is returned (no scores, logits or returned cache, and not a cache
the caller passed in to continue): their blocks are freed and their sequences padded, as
stock pads them. Sampling still draws the random numbers of every row of the call (those of
the rows that left go unused), so each row meets the random numbers it meets in stock's loop
and seeded tokens stay stock's. (On a GPU the smaller batch runs matrix products of another
shape, whose last bits may differ: in bf16, tokens can then differ where logits nearly tie.)
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nanoserve.adapters.decode_graphs import bucket_for
from nanoserve.adapters.device_sampling import (
    INVALID_PROBABILITIES,
    StopRule,
    multinomial_noise,
    processor_steps,
    unsupported,
)
from nanoserve.adapters.graph_forward import loop_decode_step
from nanoserve.adapters.hf_cache import PagedCache
from nanoserve.adapters.loop_choice import TokenChoice
from nanoserve.adapters.prefix_salt import length_dependent_rope
from nanoserve.adapters.read_back import READ_BACK_LAG, InvalidDraw, ReadBack
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.step import (
    CACHE_KWARGS,
    find_cache,
    host_to_device,
    pad_to_feed,
    state_of,
)
from nanoserve.cache.allocator import OutOfBlocks
from nanoserve.log import get_logger

_log = get_logger(__name__)

# generate's model_kwargs the loop handles; any other (not None) runs HF's loop
_KNOWN_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", *CACHE_KWARGS}
# generate's own arguments that transformers hands to ``_sample`` with the forward's: the tokenizer
# serves stop strings (a stopping criterion the loop checks apart) and token healing (done
# before the loop); no forward reads it
_GENERATE_ONLY = {"tokenizer"}
_STOCK_SAMPLE = GenerationMixin._sample
# what HF's loop calls every step and the loop does not: a model class that overrides one
# of them (to re-run its prompt, move positions, ...) runs HF's loop
_STEP_METHODS = ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation")
# 5.24 names the output's cache field "cache", 5.17 "past_key_values"
_FIELDS = GenerateDecoderOnlyOutput.__dataclass_fields__
_CACHE_FIELD = "cache" if "cache" in _FIELDS else "past_key_values"


def sample(
    model,
    original,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    **model_kwargs,
):
    """HF's ``_sample`` signature (``original`` is the class's own ``_sample``): nanoserve's
    loop when ``stock_reason`` finds nothing it cannot run, else ``original``."""
    state = state_of(model)
    reason = stock_reason(
        model, original, logits_processor, stopping_criteria, generation_config, synced_gpus,
        model_kwargs,
    )  # fmt: skip
    state.last_loop = "nanoserve" if reason is None else f"stock: {reason}"
    if reason is not None:
        _log.info("fallback: transformers' decode loop (%s)", reason)
        return original(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs,
        )  # fmt: skip
    return _loop(
        model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
        model_kwargs,
    )  # fmt: skip


def stock_reason(
    model, original, logits_processor, stopping_criteria, generation_config, synced_gpus,
    model_kwargs,
) -> str | None:  # fmt: skip
    """Why this ``_sample`` call must run HF's loop (a short phrase), or None."""
    if not state_of(model).decode_loop:
        return "decode_loop=False"
    if original is not _STOCK_SAMPLE:
        return f"{type(model).__name__} has its own _sample"
    # the loop's decode steps skip these (Phi-3's long-rope switch drops the cache there)
    own = [n for n in _STEP_METHODS if getattr(type(model), n) is not getattr(GenerationMixin, n)]
    if own:
        plain = family_for(model.config).plain_steps
        if plain is None or not plain(model, generation_config.max_length):
            return f"{type(model).__name__} has its own {own[0]}"
    if synced_gpus:
        return "synced_gpus"
    if getattr(generation_config, "is_assistant", False):
        return "an assistant model's call"
    if model.config.is_encoder_decoder:
        return "an encoder-decoder model"
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, name, False):
            return name
    cache = find_cache(model_kwargs)
    if not isinstance(cache, PagedCache):
        return "a cache other than nanoserve's PagedCache"
    if cache.drops_out is not None:
        return cache.drops_out  # rows leaving the batch would shift its dropout draws
    if cache.batch_hooks is not None:
        return f"{cache.batch_hooks} (it would see rows leave the batch)"
    rope = length_dependent_rope(model) if cache.walk is None else cache.walk.rope
    if rope is not None:  # the steps run past the stop would move its frequencies on
        return rope
    if model_kwargs.get("use_cache") is False:
        return "use_cache=False"
    for name, value in model_kwargs.items():
        if value is not None and name not in _KNOWN_KWARGS | _GENERATE_ONLY:
            return f"the forward argument {name}"
    positions = model_kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return "no 2-D position_ids"
    reason = unsupported(logits_processor, stopping_criteria)
    if reason is not None:
        return reason
    eos_ids = [c.eos_token_id for c in stopping_criteria if hasattr(c, "eos_token_id")]
    pad = generation_config._pad_token_tensor
    if eos_ids and pad is None:
        return "EOS without a pad_token_id"
    # (the loop takes token ids as int64: a float id would be truncated into a real token)
    if any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (*eos_ids, pad)):
        return "a floating-point eos_token_id or pad_token_id"
    return None


# The sequences buffer starts this many columns past the prompt and doubles as it fills:
# max_new_tokens may be far more than the rows will generate before EOS.
SEQUENCE_STEP = 512


def _loop(model, input_ids, logits_processor, stopping_criteria, config, streamer, model_kwargs):
    device = input_ids.device
    rows, prompt_len = input_ids.shape
    rule = StopRule(stopping_criteria, device)
    steps = processor_steps(logits_processor, input_ids)
    keep = config.return_dict_in_generate
    scores = [] if keep and config.output_scores else None
    raw_logits = [] if keep and config.output_logits else None
    # (int64 whatever the caller's pad tensor was: it fills int64 sequences and tokens)
    pad = config._pad_token_tensor.to(device, torch.int64) if rule.eos is not None else None
    # a cache passed in to be continued stays the caller's, whole: its rows never leave
    fresh_cache = find_cache(model_kwargs).paged.num_seqs == 0

    outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=True)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
    cache_name = next(k for k in CACHE_KWARGS if model_kwargs.get(k) is not None)
    cache = model_kwargs[cache_name]
    # the positions of the tokens whose logits are chosen from: the prompt's last (int64 as
    # ``pick_tokens`` takes them, whatever a caller's position_ids were)
    positions = (model_kwargs["position_ids"][:, -1:].expand(rows, 1) - 1).to(torch.int64)
    fixed = {cache_name: cache, "use_cache": True, "return_dict": True}
    if "logits_to_keep" in model_kwargs:
        fixed["logits_to_keep"] = 1
    logits = outputs.logits[:, -1].to(device)
    del outputs

    # int64 whatever the prompt's integer dtype, as stock's concatenation promotes it
    dtype = torch.promote_types(input_ids.dtype, torch.long)
    columns = max(rule.max_length, prompt_len + 1)
    sequences = input_ids.new_empty(rows, min(columns, prompt_len + SEQUENCE_STEP), dtype=dtype)
    sequences[:, :prompt_len] = input_ids
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)
    # Finished rows leave the batch only where nothing of theirs past EOS is returned: no
    # scores, logits or cache (stock's hold the pad steps' values)
    compact = pad is not None and not keep and fresh_cache
    batch = ActiveRows(rows, device, pad, compact=compact)
    watch = ReadBack(device, rows, streamer, batch.pad_value, rule.eos is not None)
    length, stop_at = prompt_len, None
    fed_pad = pad_to_feed(model, batch.pad_value) if pad is not None else None
    rng = _RandomStates(device) if config.do_sample else None
    # steps whose scores and logits are not returned choose on fixed buffers, replayed as a
    # graph on CUDA; the others run the same ops eagerly
    captures = _captures(model, device) and scores is None and raw_logits is None
    noise = batch.noise if config.do_sample else None
    choice = TokenChoice(steps, rule, pad, capture=captures, noise=noise)
    lent = False  # whether ``logits`` is a graph's output buffer
    state = state_of(model)
    state.loop_steps = {"direct": 0, "choice_replays": 0, "choice_captures": 0,
                        "choice_failed": None}  # fmt: skip
    while stop_at is None:
        if rng is not None:
            rng.save(length)
        chosen = choice(logits, unfinished, positions, length, lent)
        tokens, invalid = chosen.tokens, chosen.invalid
        # (kept if a later step raises)
        state.loop_steps.update(choice_replays=choice.replays, choice_captures=choice.captures,
                                choice_failed=choice.failed)  # fmt: skip
        if scores is not None:  # HF's processors each return a new tensor, never the logits
            processed = chosen.processed
            scores.append(processed.clone() if steps and processed is chosen.logits else processed)
        if raw_logits is not None:
            raw_logits.append(chosen.logits)
        if length == sequences.shape[1]:
            sequences = _wider(sequences, min(columns, 2 * length), batch.pad)
        batch.write(sequences, length, tokens)
        length += 1
        watch.push(length, unfinished, tokens, batch.rows, invalid)
        stop_at = _poll(watch, rng, drain=length >= rule.max_length)
        if stop_at is None and length >= rule.max_length:
            stop_at = length
        if stop_at is None:
            keep_at = batch.rows_to_keep(watch.finished)
            if keep_at is not None:  # the batch fits a smaller graph bucket: compact it
                index = batch.compact(keep_at, sequences, length, cache)
                tokens, positions, unfinished = tokens[index], positions[index], unfinished[index]
                for step in steps:
                    step.select(index)
                choice.reset()
            ids = tokens[:, None]
            if fed_pad is not None:
                ids = torch.where(ids == batch.pad_value, fed_pad, ids)
            try:
                step_logits = loop_decode_step(model, cache, fixed, ids, positions)
                lent = step_logits is not None
                state.loop_steps["direct"] += lent
                if not lent:
                    step_logits = model(input_ids=ids, position_ids=positions, **fixed).logits
            except OutOfBlocks:
                # A step issued before the stop was read back may need a block that the
                # call's tokens never do (a pool sized to fit them): the step stored
                # nothing, so if the rows had all stopped, the call ends as it would have.
                stop_at = _poll(watch, rng, drain=True)
                if stop_at is None:
                    raise
                break
            logits = step_logits[:, -1].to(device)
            del step_logits

    # steps issued past the stop: their tokens were never seen, their K/V is dropped, and
    # the random numbers they drew are given back (a later seeded call draws as after stock's)
    if length > stop_at:
        cache.crop(-(length - stop_at))
        if rng is not None:
            rng.restore(stop_at)
    generated = stop_at - prompt_len
    if streamer is not None:
        streamer.end()
    sequences = sequences[:, :stop_at].clone()
    if not keep:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores[:generated]) if scores is not None else None,
        logits=tuple(raw_logits[:generated]) if raw_logits is not None else None,
        attentions=None,
        hidden_states=None,
        **{_CACHE_FIELD: cache},
    )


def _poll(watch: ReadBack, rng, drain: bool) -> int | None:
    """``watch.poll(drain)``: the column count where every row has stopped, or None; a NaN
    distribution read back raises stock's error with the random state from before it, and
    what a streamer raises is raised with the random state stock's loop leaves then."""
    try:
        return watch.poll(drain=drain)
    except InvalidDraw as error:
        # stock's multinomial raises before drawing: the random state from before it
        rng.restore(error.length - 1)
        raise RuntimeError(INVALID_PROBABILITIES) from None
    except BaseException:
        # Stock's loop hands each token to the streamer right after drawing it: the steps
        # issued after the one whose tokens it raised on drew what stock never draws (none
        # did after the newest step, whose state was never saved: the state is stock's).
        if rng is not None and watch.put_raised_at in rng.states:
            rng.restore(watch.put_raised_at)
        raise


def _captures(model, device: torch.device) -> bool:
    """Whether the loop's token choice may replay graphs: on CUDA, where the model's decode
    steps do."""
    graphs = state_of(model).graphs
    return device.type == "cuda" and graphs is not None and graphs.capture


def _wider(sequences: torch.Tensor, columns: int, pad) -> torch.Tensor:
    """``sequences`` in a buffer of ``columns`` columns, the new ones ``pad`` (rows that left
    the batch read pads there; the others' columns are written step by step)."""
    wider = sequences.new_empty(sequences.shape[0], columns)
    if pad is not None:
        wider[:, sequences.shape[1] :] = pad
    wider[:, : sequences.shape[1]] = sequences
    return wider


class _RandomStates:
    """The global RNG state before each of the last few draws (the device's generator, which
    ``torch.multinomial`` uses), so the draws of steps issued past the stop can be undone."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.states: dict[int, torch.Tensor] = {}

    def save(self, column: int) -> None:
        """Keep the state before the draw of ``column``'s token (the host's copy: no sync)."""
        get = torch.cuda.get_rng_state if self.cuda else lambda _device: torch.get_rng_state()
        self.states[column] = get(self.device)
        self.states.pop(column - READ_BACK_LAG - 2, None)

    def restore(self, column: int) -> None:
        """Put back the state from before ``column``'s draw."""
        if self.cuda:
            torch.cuda.set_rng_state(self.states[column], self.device)
        else:
            torch.set_rng_state(self.states[column])


class ActiveRows:
    """Which of the call's rows are still in the decode batch (``rows``: the original row
    of each batch row). With ``compact``, rows known to have finished leave once the rest
    fits a smaller graph bucket: their blocks are freed and their sequences padded."""

    def __init__(self, rows: int, device: torch.device, pad, compact: bool):
        self.total, self.device, self.pad, self.compact_ok = rows, device, pad, compact
        self.rows = list(range(rows))
        self.index: torch.Tensor | None = None  # device int64 [len(rows)]; None: all rows
        self.pad_value = int(pad) if pad is not None else 0  # one read, before the loop

    def noise(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The random numbers of ``torch.multinomial(probs, 1)`` for the batch rows: (noise
        [T, V], each batch row's noise row int64 [B], or None for all rows). They are drawn
        as stock draws them over every row of the call (those of the rows that left are
        drawn and not used), so each batch row meets the same random numbers as in stock's
        full batch."""
        if self.index is None:
            return multinomial_noise(probs), None
        return multinomial_noise(probs, self.total), self.index

    def write(self, sequences: torch.Tensor, column: int, tokens: torch.Tensor) -> None:
        if self.index is None:
            sequences[:, column] = tokens
        else:
            sequences[self.index, column] = tokens

    def rows_to_keep(self, finished: set[int]) -> list[int] | None:
        """Batch positions to keep when dropping the rows of ``finished`` moves the batch to a
        smaller bucket; else None."""
        if not self.compact_ok:
            return None
        keep = [i for i, row in enumerate(self.rows) if row not in finished]
        if not keep or bucket_for(len(keep)) == bucket_for(len(self.rows)):
            return None
        return keep

    def compact(self, keep: list[int], sequences, column: int, cache) -> torch.Tensor:
        """Drop every batch row not in ``keep`` (from the cache too); returns the device index
        of the kept batch rows, to select each per-row tensor with."""
        kept = set(keep)
        gone = [row for i, row in enumerate(self.rows) if i not in kept]
        sequences[host_to_device(gone, self.device), column:] = self.pad
        cache.paged.reorder(keep)
        self.rows = [self.rows[i] for i in keep]
        self.index = host_to_device(self.rows, self.device)
        return host_to_device(keep, self.device)
