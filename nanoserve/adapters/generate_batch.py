"""``model.generate_batch(inputs, generation_config)`` on a patched model, on nanoserve's pool.

transformers' own ``generate_batch`` (continuous batching) refuses a patched model's
attention, and would switch the model's attention while it runs. On a patched model
``hf_native.open_doors`` routes it here instead: the prompts run as one left-padded
``generate`` call on the paged cache, and each comes back as transformers returns it: a
``GenerationOutput`` under ``req_<i>`` (``num_return_sequences`` copies under
``req_<i>__child#<j>`` first, then ``req_<i>``) with the prompt, the generated tokens (up to
and including the first EOS, as transformers keeps it) and, with
``ContinuousBatchingConfig(return_logprobs=True)``, each token's log-probability under the
processed scores.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from nanoserve.adapters.step import pad_to_feed
from nanoserve.log import get_logger

_log = get_logger(__name__)


def _token_id(value) -> int | None:
    """A token id as a Python int: from an int, a numpy integer or a 0-d integer tensor (not
    a bool); None for anything else."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _integer_tensor(value):
        return int(value)
    return None


def _integer_tensor(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _integer_vector(row) -> bool:
    """A 1-D integer numpy array or tensor."""
    if isinstance(row, np.ndarray):
        return row.ndim == 1 and np.issubdtype(row.dtype, np.integer)
    return isinstance(row, torch.Tensor) and row.dim() == 1 and _integer_tensor(row)


def _token_rows(inputs) -> list[list[int]] | None:
    """``inputs`` as lists of Python ints, as transformers' own ``generate_batch`` reads
    them (each row a list or tuple of ids, or a 1-D integer numpy array or tensor); None
    where a row is anything else or empty."""
    if not isinstance(inputs, (list, tuple)):
        return None
    rows = []
    for row in inputs:
        if _integer_vector(row):
            row = row.tolist()
        if not isinstance(row, (list, tuple)) or not row:
            return None
        ids = [_token_id(t) for t in row]
        if any(t is None for t in ids):
            return None
        rows.append(ids)
    return rows


def _check_inputs(inputs, vocab_size: int | None) -> None:
    if inputs is None:
        raise ValueError(
            "inputs: expected a list of non-empty rows of token ids (lists of ints, or 1-D "
            "integer arrays or tensors)"
        )
    if vocab_size is None:
        return
    for i, row in enumerate(inputs):
        bad = next((t for t in row if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"inputs: row {i} holds token id {bad}, outside the vocabulary [0, {vocab_size})"
            )


def _check_row_ends(config, kwargs: dict) -> None:
    """ValueError naming ``stop_strings`` / ``stopping_criteria``: a row they end is padded
    by generate up to the batch's last step, and those pads cannot be told from generated
    tokens (transformers' own generate_batch ends a request at EOS or max_new_tokens only)."""
    if getattr(config, "stop_strings", None):
        name = "stop_strings"
    elif kwargs.get("stopping_criteria"):
        name = "stopping_criteria"
    else:
        return
    raise ValueError(
        f"{name}: generate_batch ends a request at EOS or max_new_tokens only (as transformers' "
        "own does); nanoserve's runs one generate call, where a row that this ends early is "
        "padded and its pads cannot be told from tokens: call model.generate for it"
    )


def vocab_size(model) -> int | None:
    """The model's vocabulary size from its (text) config, or None when it names none."""
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def eos_ids(config) -> set[int]:
    """The EOS token ids of a generation config (transformers' -1, "none", left out)."""
    eos = config.eos_token_id
    if eos is None:
        return set()
    eos = [eos] if isinstance(eos, int) else list(eos)
    return {int(t) for t in eos if int(t) >= 0}


def left_padded(inputs, pad: int, model) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) int64 [B, longest prompt] on ``model``'s device, padded
    on the left with ``pad`` (with ``pad_to_feed``'s id where ``model`` has no embedding row
    for it: padding columns are masked out but looked up all the same)."""
    width = max(len(row) for row in inputs)
    fill = pad_to_feed(model, pad)
    ids = torch.full(
        (len(inputs), width), pad if fill is None else fill, dtype=torch.long, device="cpu"
    )
    mask = torch.zeros_like(ids)
    for i, row in enumerate(inputs):
        ids[i, width - len(row) :] = torch.tensor(row, device="cpu")
        mask[i, width - len(row) :] = 1
    return ids.to(model.device), mask.to(model.device)


def _fill_defaults(config) -> None:
    """``config``'s unset options set to generate's own defaults, so that generate takes none
    from the model's generation config (transformers' generate_batch reads only the config
    it is given)."""
    defaults = getattr(type(config), "_get_default_generation_params", None)
    for name, value in (defaults() if defaults is not None else {}).items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)


def _request_ids(num_inputs: int, copies: int) -> list[str]:
    """Row order of the generate call (copies of a prompt side by side) to transformers'
    request ids: the forked children first, the parent last."""
    ids = []
    for i in range(num_inputs):
        ids += [f"req_{i}__child#{j}" for j in range(copies - 1)] + [f"req_{i}"]
    return ids


def paged_generate_batch(
    model,
    inputs: list[list[int]],
    generation_config=None,
    continuous_batching_config=None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    **kwargs,
) -> dict[str, GenerationOutput]:
    """transformers' ``generate_batch`` contract on the patched ``model``'s paged pool.

    ``inputs``: token ids of each prompt. Returns {request id: GenerationOutput} in input
    order. ``kwargs`` that name a generation-config field (``max_new_tokens``,
    ``num_return_sequences``, ``eos_token_id``, ...) update a copy of the config; the rest go
    to ``generate``. The continuous
    batching manager's options (``persistent_manager``, ``warmup``, ``progress_bar``,
    ``continuous_batching_config`` other than ``return_logprobs``) have nothing to set here.
    """
    inputs = _token_rows(inputs)
    _check_inputs(inputs, vocab_size(model))
    if not inputs:
        return {}
    if record_timestamps:
        raise ValueError(
            "record_timestamps: nanoserve's generate_batch runs one generate call and has no "
            "per-token timestamps (nanoserve.unpatch_model(model) for transformers' own)"
        )
    config = copy.deepcopy(generation_config or model.generation_config)
    if generation_config is not None:
        _fill_defaults(config)  # (transformers' own reads no option of the model's then)
    # the rows' copies, EOS and pad below must be the ones generate uses
    length_given = "max_length" in kwargs
    kwargs = config.update(**kwargs)
    if config.max_new_tokens is None:
        ignored = " (max_length, which requests of many lengths share, is not one)"
        raise ValueError(
            "max_new_tokens: none given (in the call or the generation config); transformers' "
            "own generate_batch then runs every request to EOS, nanoserve's one generate call "
            f"needs a limit: pass max_new_tokens{ignored if length_given else ''}"
        )
    _check_row_ends(config, kwargs)
    logprobs = bool(getattr(continuous_batching_config, "return_logprobs", False))
    eos = eos_ids(config)
    # transformers' -1 ("disabled") and None mean no EOS; an empty list keeps generate from
    # filling model.generation_config's EOS in (None would), so it stops where we cut
    config.eos_token_id = sorted(eos)
    config.return_dict_in_generate = True
    config.output_scores = logprobs
    pad = config.pad_token_id if config.pad_token_id is not None else min(eos, default=0)
    ids, mask = left_padded(inputs, pad, model)
    copies = config.num_return_sequences or 1
    if (config.num_beams or 1) > 1 and logprobs:
        raise ValueError(
            "num_beams: return_logprobs takes each row's scores step by step, which beam "
            "search reorders across beams (transformers' generate_batch has no beams)"
        )
    if (config.num_beams or 1) > 1 and not eos and not pad:
        raise ValueError(
            "num_beams: beam search with no EOS id needs a pad_token_id other than 0 "
            "(transformers' beam search then reads eos_token_id[0]); give either"
        )
    # with no EOS and no pad id, generate would take its pad from the empty EOS list
    config.pad_token_id = pad
    _log.info("generate_batch: %d requests as one generate call on the paged pool", len(inputs))

    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            **kwargs,
        )
    end = time.perf_counter()

    new = out.sequences[:, ids.shape[1] :].tolist()
    results = {}
    for row, request_id in enumerate(_request_ids(len(inputs), copies)):
        tokens = new[row]
        stop = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        tokens = tokens[:stop]
        result = GenerationOutput(
            request_id=request_id,
            prompt_ids=list(inputs[row // copies]),
            generated_tokens=tokens,
            status=RequestStatus.FINISHED,
            created_time=start,
            lifespan=(start, end),
        )
        if logprobs:
            result.logprobs = [
                torch.log_softmax(out.scores[i][row].float(), dim=-1)[t].item()
                for i, t in enumerate(tokens)
            ]
        results[request_id] = result
    return results
