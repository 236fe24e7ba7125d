"""HF's logits processors and stopping criteria of greedy and multinomial sampling, as torch
ops on the device that never read a tensor back on the host.

``processor_steps`` turns the ``LogitsProcessorList`` that ``generate`` built into one step
per entry, each computing exactly what the HF processor computes (the same ops in the same
order, or for top-k on CUDA ``top_k_filter``, whose threshold is the one ``torch.topk`` gives
there; so ``output_scores`` and seeded sampling give stock's values). What differs is the
state they keep: the repetition penalty keeps a ``[rows, vocab + 1]`` mask of the tokens a
row has seen (updated with each step's tokens) instead of gathering over the growing
``input_ids``, and the length processors take the length as a host integer. An entry of any
other type makes ``unsupported`` name it, and the caller runs HF's loop instead.
"""

from __future__ import annotations

import math

import torch
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

from nanoserve.kernels.top_k import input_problem as top_k_problem
from nanoserve.kernels.top_k import top_k_filter, top_k_filter_ref


class _Step:
    """One processor: ``__call__(scores [B, V] float32, length) -> scores``; ``observe``
    sees each step's chosen tokens [B]; ``select`` keeps the rows of a compacted batch."""

    def __call__(self, scores: torch.Tensor, length: int) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, tokens: torch.Tensor, length: int) -> None:
        """``tokens`` [B] were chosen at column ``length`` (the length ``__call__`` had)."""

    def select(self, index: torch.Tensor) -> None:
        pass

    def branch(self, length: int) -> object:
        """What of the host's ``length`` this step's device ops depend on (None: nothing);
        a captured graph of the step is replayed only at lengths of the same branch."""
        return None


class _Temperature(_Step):
    def __init__(self, p: lp.TemperatureLogitsWarper):
        self.temperature = p.temperature

    def __call__(self, scores, length):
        return scores / self.temperature


class _TopK(_Step):
    def __init__(self, p: lp.TopKLogitsWarper):
        self.top_k, self.filter_value = p.top_k, p.filter_value

    def __call__(self, scores, length):
        top_k = min(self.top_k, scores.size(-1))
        if top_k_problem(scores, top_k, self.filter_value) is None:
            return top_k_filter(scores, top_k, self.filter_value)
        # (a fill the launcher refuses, as a tensor or a numpy scalar: HF's ops, errors too)
        return top_k_filter_ref(scores, top_k, self.filter_value)


class _TopP(_Step):
    def __init__(self, p: lp.TopPLogitsWarper):
        self.top_p, self.filter_value, self.keep = p.top_p, p.filter_value, p.min_tokens_to_keep

    def __call__(self, scores, length):
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - self.top_p)
        sorted_remove[..., -self.keep :] = 0
        remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
        return scores.masked_fill(remove, self.filter_value)


class _MinP(_Step):
    def __init__(self, p: lp.MinPLogitsWarper):
        self.min_p, self.filter_value, self.keep = p.min_p, p.filter_value, p.min_tokens_to_keep

    def __call__(self, scores, length):
        probs = torch.softmax(scores, dim=-1)
        remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        if self.keep > 1 or not self.min_p <= 1:
            keep = torch.topk(probs, min(self.keep, probs.shape[-1]), dim=-1).indices
            remove.scatter_(-1, keep, False)
        # (else HF's topk would keep one largest probability, which min_p <= 1 never removes)
        return scores.masked_fill(remove, self.filter_value)


class _RepetitionPenalty(_Step):
    """Tokens a row has seen are divided (positive) or multiplied (negative) by the penalty:
    every column of the sequence from ``prompt_ignore_length`` on (an int, or one per row),
    the prompt's and then each chosen token's; a token chosen at a column before it is
    never counted, as stock slices the growing ``input_ids``. Ids past the vocabulary land
    in a dropped last column."""

    def __init__(self, p: lp.RepetitionPenaltyLogitsProcessor, prompt: torch.Tensor):
        self.penalty = p.penalty
        ignore = getattr(p, "prompt_ignore_length", None)
        self.ignore = int(ignore) if isinstance(ignore, int) else 0
        self.ignore_rows: torch.Tensor | None = None  # int64 [B] (a tensor was given)
        self.most_ignored = self.ignore
        if isinstance(ignore, torch.Tensor):  # 5.24 passes each row's left padding
            if ignore.shape[0] != prompt.shape[0]:
                raise ValueError("Incompatible `prompt_ignore_length` batch size")  # stock's
            self.ignore_rows = ignore.to(prompt.device, torch.int64)
            self.most_ignored = int(ignore.max()) if ignore.numel() else 0  # (once a call)
            columns = torch.arange(prompt.shape[1], device=prompt.device)
            ignored = columns[None, :] < self.ignore_rows[:, None]
            prompt = prompt.masked_fill(ignored, torch.iinfo(prompt.dtype).max)
        elif self.ignore:
            prompt = prompt[:, self.ignore :]
        self.prompt = prompt
        self.seen: torch.Tensor | None = None  # bool [B, V + 1], built at the first step

    def branch(self, length):
        # a token chosen at column ``length`` counts from ``ignore`` on; per row, each
        # length below the last row's ignore is its own branch (those steps run eagerly)
        if self.ignore_rows is not None:
            return length if length < self.most_ignored else None
        return length >= self.ignore

    def __call__(self, scores, length):
        vocab = scores.shape[-1]
        if self.seen is None:
            rows = scores.shape[0]
            self.seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=scores.device)
            self.seen.scatter_(1, self.prompt.to(scores.device).clamp(max=vocab), True)
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(self.seen[:, :vocab], penalized, scores)

    def observe(self, tokens, length):
        if self.seen is None or length < self.ignore:
            return
        vocab = self.seen.shape[1] - 1
        # a finished row's pad may be no id at all (-1, or past the vocabulary): the dropped
        # last column records it
        tokens = torch.where((tokens < 0) | (tokens > vocab), vocab, tokens)
        if self.ignore_rows is not None and length < self.most_ignored:
            # rows still ignoring this column mark the dropped last column instead
            tokens = torch.where(self.ignore_rows.to(tokens.device) <= length, tokens, vocab)
        self.seen.scatter_(1, tokens[:, None], True)

    def select(self, index):
        if self.seen is not None:
            self.seen = self.seen[index]
        if self.ignore_rows is not None:
            self.ignore_rows = self.ignore_rows[index.to(self.ignore_rows.device)]


class _EosBlocked(_Step):
    """EOS gets -inf while ``length - skip < minimum`` (min_length, min_new_tokens)."""

    def __init__(self, minimum: int, skip: int, eos_token_id):
        self.minimum, self.skip = minimum, skip
        self.eos = _id_list(eos_token_id)
        self.mask: torch.Tensor | None = None

    def branch(self, length):
        return length - self.skip >= self.minimum

    def __call__(self, scores, length):
        if self.branch(length):
            return scores
        if self.mask is None:
            vocab = torch.arange(scores.shape[-1], device=scores.device)
            self.mask = torch.isin(vocab, self.eos.to(scores.device))
        return torch.where(self.mask, -math.inf, scores)


def _min_length(p: lp.MinLengthLogitsProcessor, prompt):
    return _EosBlocked(p.min_length, 0, p.eos_token_id)


def _min_new_tokens(p: lp.MinNewTokensLengthLogitsProcessor, prompt):
    return _EosBlocked(p.min_new_tokens, p.prompt_length_to_skip, p.eos_token_id)


_STEPS = {
    lp.TemperatureLogitsWarper: lambda p, prompt: _Temperature(p),
    lp.TopKLogitsWarper: lambda p, prompt: _TopK(p),
    lp.TopPLogitsWarper: lambda p, prompt: _TopP(p),
    lp.MinPLogitsWarper: lambda p, prompt: _MinP(p),
    lp.RepetitionPenaltyLogitsProcessor: _RepetitionPenalty,
    lp.MinLengthLogitsProcessor: _min_length,
    lp.MinNewTokensLengthLogitsProcessor: _min_new_tokens,
}


def unsupported(logits_processor, stopping_criteria) -> str | None:
    """Why these processors / criteria need HF's loop (a phrase naming the entry), or None
    when ``processor_steps`` and ``stop_rule`` compute them exactly."""
    for p in logits_processor:
        if type(p) not in _STEPS:
            return f"logits processor {type(p).__name__}"
        if getattr(p, "logits_indices", None) is not None:  # HF's packed batches only
            return "repetition penalty with packed logits_indices"
    kinds = [type(c) for c in stopping_criteria]
    for kind in kinds:
        if kind not in (sc.MaxLengthCriteria, sc.EosTokenCriteria):
            return f"stopping criterion {kind.__name__}"
    if kinds.count(sc.MaxLengthCriteria) != 1:
        return "no single max_length"
    return None


def processor_steps(logits_processor, prompt: torch.Tensor) -> list[_Step]:
    """One device step per entry of ``logits_processor`` (all supported: ``unsupported``
    said None); ``prompt`` int64 [B, L] is the ``input_ids`` generate starts from."""
    return [_STEPS[type(p)](p, prompt) for p in logits_processor]


def apply_steps(steps: list[_Step], scores: torch.Tensor, length: int) -> torch.Tensor:
    """``scores`` [B, V] float32 processed as HF's list would at sequence length ``length``."""
    for step in steps:
        scores = step(scores, length)
    return scores


# stock's message when a distribution to sample holds NaN (``torch.multinomial``'s check)
INVALID_PROBABILITIES = "probability tensor contains either `inf`, `nan` or element < 0"


def multinomial_noise(probs: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """The random numbers ``torch.multinomial(probs, 1)`` draws for ``probs`` [B, V], or for
    a [total, V] tensor (a batch some rows have left): q ~ Exp(1), float32 [B or total, V].
    ATen's one-sample draw takes argmax(probs / q) a row; ``pick_tokens`` does the same."""
    rows = probs.shape[0] if total is None else total
    return probs.new_empty(rows, probs.shape[1]).exponential_(1)


def _id_list(ids) -> torch.Tensor:
    """Token ids (an int, a list or a tensor) as a 1-D tensor: a tensor stays where it is, the
    others are made on the host whatever the default device (``torch.device`` contexts)."""
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1)
    return torch.tensor(ids, device="cpu").reshape(-1)


class StopRule:
    """HF's ``MaxLengthCriteria`` (a host length) and ``EosTokenCriteria`` (on the device)."""

    def __init__(self, stopping_criteria, device: torch.device):
        self.max_length = next(
            c.max_length for c in stopping_criteria if type(c) is sc.MaxLengthCriteria
        )
        eos = [c.eos_token_id for c in stopping_criteria if type(c) is sc.EosTokenCriteria]
        ids = [_id_list(e) for e in eos]
        self.eos = torch.cat(ids).to(device, torch.int64) if ids else None
