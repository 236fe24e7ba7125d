"""nanoserve's own loop for HF's greedy and multinomial sampling (``_sample``).

A patched model's ``generate`` reaches ``sample`` through the class hook (``sample_hook.py``)
with everything HF prepared: the processors, the stopping criteria, the expanded prompts and
the cache. ``stock_reason`` says whether the loop can give exactly what HF's ``_sample``
gives; if not, HF's ``_sample`` runs unchanged and the reason is kept
(``decode_graph_stats(model)["decode_loop"]``).

The loop prefills through HF's ``_prefill`` (so chunked prefill and prefix sharing are as
before), then runs each decode step through the patched forward with only the arguments a
paged decode step needs (on CUDA a replayed graph), processes the logits and picks the
token on the device (``device_sampling.py``), and writes it into a preallocated
``sequences`` buffer. Whether every row has finished is copied back without waiting: the
host reads a step's flag (and the streamer its tokens) once the device has finished that
step, at most ``READ_BACK_LAG`` steps behind the step it is issuing. The steps run past the
stop are cut from the returned sequences, scores and logits and cropped from the cache, so
the result is stock's. (Those steps still drew from the global RNG when sampling.)
"""

from __future__ import annotations

from collections import deque

import torch
from transformers import GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

from nanoserve.adapters.device_sampling import StopRule, apply_steps, processor_steps, unsupported
from nanoserve.adapters.hf_cache import PagedCache
from nanoserve.adapters.step import CACHE_KWARGS, find_cache, state_of

READ_BACK_LAG = 4  # decode steps the host may issue past the last one it has read back

# generate's model_kwargs the loop handles; any other (not None) runs HF's loop
_KNOWN_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", *CACHE_KWARGS}
_STOCK_SAMPLE = GenerationMixin._sample
_CACHE_FIELD = (
    "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else ("past_key_values")
)


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
    if synced_gpus:
        return "synced_gpus"
    if getattr(generation_config, "is_assistant", False):
        return "an assistant model's call"
    if model.config.is_encoder_decoder:
        return "an encoder-decoder model"
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, name, False):
            return name
    if not isinstance(find_cache(model_kwargs), PagedCache):
        return "a cache other than nanoserve's PagedCache"
    if model_kwargs.get("use_cache") is False:
        return "use_cache=False"
    for name, value in model_kwargs.items():
        if value is not None and name not in _KNOWN_KWARGS:
            return f"the forward argument {name}"
    positions = model_kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return "no 2-D position_ids"
    reason = unsupported(logits_processor, stopping_criteria)
    if reason is not None:
        return reason
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    if has_eos and generation_config._pad_token_tensor is None:
        return "EOS without a pad_token_id"
    return None


def _loop(model, input_ids, logits_processor, stopping_criteria, config, streamer, model_kwargs):
    device = input_ids.device
    rows, prompt_len = input_ids.shape
    rule = StopRule(stopping_criteria, device)
    steps = processor_steps(logits_processor, input_ids)
    keep = config.return_dict_in_generate
    scores = [] if keep and config.output_scores else None
    raw_logits = [] if keep and config.output_logits else None
    pad = config._pad_token_tensor.to(device) if rule.eos is not None else None

    outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=True)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
    cache_name = next(k for k in CACHE_KWARGS if model_kwargs.get(k) is not None)
    cache = model_kwargs[cache_name]
    positions = model_kwargs["position_ids"][:, -1:].expand(rows, 1).clone()
    fixed = {cache_name: cache, "use_cache": True, "return_dict": True}
    if "logits_to_keep" in model_kwargs:
        fixed["logits_to_keep"] = 1
    logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
    del outputs

    sequences = input_ids.new_empty(rows, max(rule.max_length, prompt_len + 1))
    sequences[:, :prompt_len] = input_ids
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    watch = _ReadBack(device, rows, streamer, rule.eos is not None)
    length, stop_at = prompt_len, None
    while stop_at is None:
        processed = apply_steps(steps, logits, length)
        if scores is not None:
            scores.append(processed)
        if raw_logits is not None:
            raw_logits.append(logits)
        if config.do_sample:
            probs = torch.nn.functional.softmax(processed, dim=-1)
            tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(processed, dim=-1)
        if pad is not None:  # finished rows get the pad token, as in stock
            tokens = tokens * unfinished + pad * (1 - unfinished)
        sequences[:, length] = tokens
        length += 1
        for step in steps:
            step.observe(tokens)
        if rule.eos is not None:
            unfinished = unfinished & ~rule.finished(tokens)
        watch.push(length, unfinished, tokens)
        stop_at = watch.poll(drain=length >= rule.max_length)
        if stop_at is None and length >= rule.max_length:
            stop_at = length
        if stop_at is None:
            step_out = model(input_ids=tokens[:, None], position_ids=positions, **fixed)
            positions = positions + 1
            logits = step_out.logits[:, -1].to(copy=True, dtype=torch.float32, device=device)
            del step_out

    # steps issued past the stop: their tokens were never seen, their K/V is dropped
    if length > stop_at:
        cache.crop(-(length - stop_at))
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


class _ReadBack:
    """Each step's "every row finished" flag and, for a streamer, its tokens, copied to the
    host without waiting; ``poll`` consumes the steps the device has finished (on CPU, and
    on CUDA when the host is ``READ_BACK_LAG`` steps ahead, it waits for the oldest)."""

    def __init__(self, device: torch.device, rows: int, streamer, has_eos: bool):
        self.streamer, self.has_eos = streamer, has_eos
        self.cuda = device.type == "cuda"
        slots = READ_BACK_LAG + 2
        self.flags = torch.zeros(slots, dtype=torch.bool, pin_memory=self.cuda)
        self.tokens = torch.zeros(slots, rows, dtype=torch.long, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]
        self.pending: deque[tuple[int, int]] = deque()  # (sequence length, slot)
        self.next_slot = 0

    def push(self, length: int, unfinished: torch.Tensor, tokens: torch.Tensor) -> None:
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % len(self.events)
        if not (self.has_eos or self.streamer is not None):
            return
        if self.has_eos:
            self.flags[slot].copy_(unfinished.max() == 0, non_blocking=True)
        if self.streamer is not None:
            self.tokens[slot].copy_(tokens, non_blocking=True)
        if self.cuda:
            self.events[slot].record()
        self.pending.append((length, slot))

    def poll(self, drain: bool = False) -> int | None:
        """The sequence length at which every row had finished, once read back; else None.
        ``drain`` reads every pending step."""
        while self.pending:
            length, slot = self.pending[0]
            event = self.events[slot]
            ready = drain or len(self.pending) > READ_BACK_LAG
            if not ready and not (event is not None and event.query()):
                return None
            if event is not None:
                event.synchronize()
            self.pending.popleft()
            if self.streamer is not None:
                self.streamer.put(self.tokens[slot].clone())
            if self.has_eos and bool(self.flags[slot]):
                self.pending.clear()
                return length
        return None
